"""C1/C2 KV compression: softmax-gated pooling of ``ratio`` consecutive tokens, with a state ring.

A sequence's raw ``(score, latent)`` pairs are kept in a per-sequence ring of ``L`` fp32 entries
(``state[slot, position % L]``) so that a group split across two calls, or re-computed after a
rollback, can read its earlier members. ``L = ratio + max_backtracking - 1`` in the model.
"""
from __future__ import annotations

import torch

from deepinfer.hal.spec import DEFAULT_TOLERANCES, OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks


LATENT_DTYPES = (torch.float32, torch.bfloat16)


def compress_tokens(latent: torch.Tensor, score: torch.Tensor | None, positions: torch.Tensor,
                    state_slots: torch.Tensor, chunk_start: torch.Tensor, state: torch.Tensor | None,
                    ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress tokens ``ratio`` to one; returns ``(out bf16 [T, D], emit bool [T])``.

    ``latent``, ``score``: float32 or bf16 ``[T, D]`` (read as float32; the projections'
    output, cast by no launch of its own); ``positions``, ``state_slots``, ``chunk_start``:
    int64 ``[T]`` (absolute position, the sequence's state slot, the first position of the
    sequence in this call); the tokens of one sequence are contiguous and ascending.
    ``ratio == 1``: ``out = latent``, all emit (``score`` and ``state`` may be None).
    ``ratio >= 2``: the token at position ``p`` emits iff ``(p + 1) % ratio == 0``; its row is
    ``sum_i softmax_i(score_i[c]) * latent_i[c]`` per channel ``c`` over positions
    ``p - ratio + 1 .. p``. Members at ``q >= chunk_start`` are rows of this call (row
    ``t - (p - q)``), earlier ones are read from ``state[slot, q % L]`` (``[..., 0, :]`` score,
    ``[..., 1, :]`` latent), ``state`` being float32 ``[num_slots, L >= ratio, 2, D]``. Then every
    token's pair is written, in place, to ``state[slot, p % L]`` (the latest position wins).
    Rows that do not emit are zero. The pooling is float32 and ``out`` is its rounding to bf16
    whatever the input dtype, as DeepInfer's compressor writes it."""
    check_compress_tokens(latent, positions, state_slots, chunk_start, ratio)
    if ratio == 1:
        return latent.to(torch.bfloat16, copy=True), torch.ones_like(positions, dtype=torch.bool)
    check_compress_state(latent, score, state_slots, state, ratio)
    latent, score = latent.float(), score.float()
    emit = (positions + 1) % ratio == 0
    member_scores, member_latents = _group_members(emit, latent, score, positions, state_slots, chunk_start,
                                                   state, ratio)
    pooled = (torch.softmax(member_scores, dim=1) * member_latents).sum(dim=1)
    out = torch.where(emit[:, None], pooled, torch.zeros((), device=latent.device))
    _store(state, score, latent, positions, state_slots)
    return out.to(torch.bfloat16), emit


def _group_members(emit, latent, score, positions, state_slots, chunk_start, state, ratio):
    """``(scores, latents)``, each ``[T, ratio, D]``: the members of the group each token would
    close (meaningful where ``emit``; every row is computed, so no shape depends on the data)."""
    back = torch.arange(ratio - 1, -1, -1, device=latent.device)
    member_positions = positions[:, None] - back
    in_call = member_positions >= chunk_start[:, None]
    call_rows = torch.arange(positions.shape[0], device=latent.device)[:, None] - back
    if value_checks():
        rows = emit.nonzero().squeeze(1)
        check_contiguous(call_rows[rows], in_call[rows], member_positions[rows], positions, state_slots,
                          state_slots[rows])
    call_rows = call_rows.clamp(min=0)
    ring = state[state_slots[:, None], member_positions % state.shape[1]]
    in_call = in_call[..., None]
    return (torch.where(in_call, score[call_rows], ring[:, :, 0]),
            torch.where(in_call, latent[call_rows], ring[:, :, 1]))


def _store(state, score, latent, positions, state_slots) -> None:
    """Write each token's (score, latent) to its ring entry; the latest position of a slot wins
    (within a call a slot's tokens are contiguous and ascending, so the latest is the last row)."""
    num_slots, ring_length = state.shape[:2]
    entry = state_slots * ring_length + positions % ring_length
    rows = torch.arange(positions.shape[0], device=positions.device)
    winner = torch.full((num_slots * ring_length,), -1, dtype=rows.dtype, device=rows.device)
    winner = winner.scatter_reduce(0, entry, rows, reduce="amax")[entry]
    pairs = torch.stack((score, latent), dim=1)[winner]
    state.view(num_slots * ring_length, *state.shape[2:]).index_copy_(0, entry, pairs)


def check_compress_tokens(latent, positions, state_slots, chunk_start, ratio) -> None:
    if not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be an int >= 1, got {ratio!r}")
    if latent.dtype not in LATENT_DTYPES or latent.ndim != 2:
        raise ValueError(f"latent must be float32 or bf16 [T, D], got {latent.dtype} {tuple(latent.shape)}")
    tokens = latent.shape[0]
    for name, value in (("positions", positions), ("state_slots", state_slots), ("chunk_start", chunk_start)):
        if value.dtype != torch.int64 or tuple(value.shape) != (tokens,):
            raise ValueError(f"{name} must be int64 [{tokens}], got {value.dtype} {tuple(value.shape)}")
    if value_checks() and tokens and ((chunk_start < 0).any() or (chunk_start > positions).any()):
        raise ValueError("chunk_start must satisfy 0 <= chunk_start <= positions (the first position of "
                         "each token's sequence in this call)")


def check_compress_state(latent, score, state_slots, state, ratio) -> None:
    if score is None or score.shape != latent.shape or score.dtype not in LATENT_DTYPES:
        seen = None if score is None else f"{score.dtype} {tuple(score.shape)}"
        raise ValueError(f"ratio {ratio} needs score float32 or bf16 {tuple(latent.shape)}, got {seen}")
    if (state is None or state.dtype != torch.float32 or state.ndim != 4
            or tuple(state.shape[2:]) != (2, latent.shape[1]) or state.shape[1] < ratio):
        seen = None if state is None else f"{state.dtype} {tuple(state.shape)}"
        raise ValueError(f"ratio {ratio} needs state float32 [num_slots, L >= {ratio}, 2, {latent.shape[1]}], "
                         f"got {seen}")
    if value_checks() and state_slots.numel() and (state_slots.min() < 0 or state_slots.max() >= state.shape[0]):
        raise ValueError(f"state_slots must lie in [0, {state.shape[0]}), seen "
                         f"[{state_slots.min().item()}, {state_slots.max().item()}]")


def check_contiguous(call_rows, in_call, member_positions, positions, state_slots, group_slots) -> None:
    rows = call_rows[in_call]
    safe_rows = rows.clamp(min=0)
    wanted_slots = group_slots[:, None].expand_as(call_rows)[in_call]
    if ((rows < 0).any() or (positions[safe_rows] != member_positions[in_call]).any()
            or (state_slots[safe_rows] != wanted_slots).any()):
        raise ValueError("the tokens of a sequence must be contiguous rows with ascending positions from "
                         "chunk_start; a group member's row does not hold the expected position and slot")


def _case(sequences, dim, ratio, num_slots=0, ring_length=0, dtype=torch.float32):
    """``sequences``: (state slot, first position in this call, token count) per sequence;
    ``dtype``: of latent and score."""
    def make(gen: torch.Generator, device: torch.device):
        positions = torch.cat([torch.arange(first, first + count) for _, first, count in sequences])
        slots = torch.cat([torch.full((count,), slot) for slot, _, count in sequences])
        starts = torch.cat([torch.full((count,), first) for _, first, count in sequences])
        tokens = positions.numel()
        args = {"latent": torch.randn(tokens, dim, generator=gen).to(dtype), "score": None, "positions": positions,
                "state_slots": slots, "chunk_start": starts, "state": None, "ratio": ratio}
        if ratio > 1:
            args["score"] = (2 * torch.randn(tokens, dim, generator=gen)).to(dtype)
            args["state"] = torch.randn(num_slots, ring_length, 2, dim, generator=gen)
        return {name: value.to(device) if isinstance(value, torch.Tensor) else value
                for name, value in args.items()}
    return make


register(OpSpec(
    name="compress_tokens",
    activations=False,
    summary="C1/C2 KV compression: softmax-gated pooling of ratio tokens, per-sequence state ring",
    reference=compress_tokens,
    tolerances={dtype: DEFAULT_TOLERANCES[torch.bfloat16] for dtype in LATENT_DTYPES},  # a bf16 output
    cases=(
        OpCase("c1_tiny", _case([(0, 3, 5)], 64, ratio=1)),
        OpCase("c2_prefill_straddle", _case([(2, 3, 6), (0, 0, 5)], 64, 2, num_slots=3, ring_length=7)),
        OpCase("c2_decode", _case([(1, 5, 1), (0, 8, 1), (3, 1, 1)], 64, 2, num_slots=4, ring_length=7)),
        OpCase("ratio4_chunk", _case([(1, 2, 8)], 32, 4, num_slots=2, ring_length=6)),
        OpCase("c2_bf16_inputs", _case([(2, 3, 6), (0, 0, 5)], 64, 2, num_slots=3, ring_length=7,
                                       dtype=torch.bfloat16)),
        OpCase("c1_bf16_inputs", _case([(0, 3, 5)], 64, ratio=1, dtype=torch.bfloat16)),
        OpCase("v41_c2_prefill", _case([(0, 7, 32), (5, 0, 32)], 512, 2, num_slots=8, ring_length=7), "real"),
        OpCase("v41_c2_decode", _case([(slot, 3 + slot, 1) for slot in range(64)], 512, 2, num_slots=64,
                                      ring_length=7), "real"),
        OpCase("v41_c1", _case([(0, 0, 64)], 512, 1), "real"),
    ),
))
