"""KV compression in two Triton kernels, one program per (token, channel block) each: the pooling
kernel reads each closing token's ``ratio`` members (rows of this call, or the state ring for
positions before the call) and writes the softmax-gated sum; the store kernel, launched after it,
writes every token's (score, latent) pair to its ring entry, so no member is read after it is
overwritten."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_backends.sm100.fused.swa_indices import floor_mod

BLOCK_CHANNELS = 512
"""Widest channel block of a program; wider rows take several blocks."""


@triton.jit
def _member(values, ring, positions, state_slots, chunk_start, t, channels, inside, dim, num_slots, ring_length,
            back):
    """Channels of the member ``back`` positions before token ``t``: ``values`` row ``max(t - back,
    0)`` when inside this call, else ``ring`` (``state`` offset to the score or latent half) at
    entry ``[slot, position mod L]``; zeros for a slot outside the state."""
    member = tl.load(positions + t) - back
    start = tl.load(chunk_start + t)
    in_call = member >= start
    slot = tl.load(state_slots + t)
    entry = (slot * ring_length + floor_mod(member, ring_length)) * 2 * dim + channels
    from_ring = tl.where((member < start) & (slot >= 0) & (slot < num_slots), inside, False)
    call_row = tl.maximum(t - back, 0)
    return tl.where(in_call, tl.load(values + call_row * dim + channels, mask=tl.where(in_call, inside, False),
                                     other=0.0).to(tl.float32),
                    tl.load(ring + entry, mask=from_ring, other=0.0))


@triton.jit
def compress_pool_kernel(latent, score, state, positions, state_slots, chunk_start, out, emit, dim, num_slots,
                         ring_length, RATIO: tl.constexpr, BLOCK: tl.constexpr):
    """Channels ``[BLOCK * pid1, ...)`` of ``out bf16 [T, dim]`` for token ``t = pid0``: when its
    position ``p`` closes a group (``(p + 1) % RATIO == 0``), ``sum_i softmax_i(score_i) *
    latent_i`` over the members at ``p - RATIO + 1 .. p`` in order (float32, rounded once to bf16),
    else zeros; ``emit[t]`` (int8)
    says which. ``RATIO == 1`` copies ``latent`` and emits every token."""
    t = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = channels < dim
    if RATIO == 1:
        tl.store(out + t * dim + channels, tl.load(latent + t * dim + channels, mask=inside).to(tl.bfloat16),
                 mask=inside)
        if tl.program_id(1) == 0:
            tl.store(emit + t, 1)
    else:
        closes = floor_mod(tl.load(positions + t) + 1, RATIO) == 0
        pooled = tl.zeros((BLOCK,), tl.float32)
        if closes:
            peak = tl.full((BLOCK,), float("-inf"), tl.float32)
            for back in tl.static_range(RATIO - 1, -1, -1):
                peak = tl.maximum(peak, _member(score, state, positions, state_slots, chunk_start, t, channels,
                                                inside, dim, num_slots, ring_length, back))
            total = tl.zeros((BLOCK,), tl.float32)
            for back in tl.static_range(RATIO - 1, -1, -1):
                total += tl.exp(_member(score, state, positions, state_slots, chunk_start, t, channels, inside, dim,
                                        num_slots, ring_length, back) - peak)
            for back in tl.static_range(RATIO - 1, -1, -1):
                weight = tl.exp(_member(score, state, positions, state_slots, chunk_start, t, channels, inside, dim,
                                        num_slots, ring_length, back) - peak) / total
                pooled += weight * _member(latent, state + dim, positions, state_slots, chunk_start, t, channels,
                                           inside, dim, num_slots, ring_length, back)
        tl.store(out + t * dim + channels, pooled.to(tl.bfloat16), mask=inside)
        if tl.program_id(1) == 0:
            tl.store(emit + t, closes.to(tl.int8))


@triton.jit
def compress_store_kernel(latent, score, state, positions, state_slots, tokens, dim, num_slots, ring_length,
                          BLOCK: tl.constexpr):
    """Channels ``[BLOCK * pid1, ...)`` of token ``t = pid0``'s ``(score, latent)`` written to
    ``state[slot, p mod L]``, unless the row ``t + L`` (the same sequence ``L`` positions on, the
    tokens of a sequence being contiguous) holds the same entry: the latest position wins. Slots
    outside the state are skipped."""
    t = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(state_slots + t)
    position = tl.load(positions + t)
    later = t + ring_length
    later_live = later < tokens
    later_slot = tl.load(state_slots + later, mask=later_live, other=-1)
    later_position = tl.load(positions + later, mask=later_live, other=0)
    latest = (later_slot != slot) | (floor_mod(later_position, ring_length) != floor_mod(position, ring_length))
    keep = tl.where((slot >= 0) & (slot < num_slots) & latest, channels < dim, False)
    entry = (slot * ring_length + floor_mod(position, ring_length)) * 2 * dim + channels
    tl.store(state + entry, tl.load(score + t * dim + channels, mask=keep, other=0.0).to(tl.float32), mask=keep)
    tl.store(state + entry + dim, tl.load(latent + t * dim + channels, mask=keep, other=0.0).to(tl.float32),
             mask=keep)


def main() -> None:
    """Check the compression kernels against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("compress_tokens")


if __name__ == "__main__":
    main()
