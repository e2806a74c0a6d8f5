"""sm100 ``compress_tokens``: the pooling kernel, then the state-ring store kernel
(:mod:`.fused.compress`); ``ratio == 1`` is one copy launch."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.compress import check_contiguous, check_compress_state, check_compress_tokens
from deepinfer.hal.value_checks import value_checks
from deepinfer_backends.sm100.launch import on_device, require


def compress_tokens(latent, score, positions, state_slots, chunk_start, state, ratio):
    """HAL ``compress_tokens`` for CUDA tensors: ``(out bf16 [T, D], emit bool [T])``, the
    ``(score, latent)`` pairs written to ``state`` in place (a contiguous ``state`` is required).
    Tokens whose state slot lies outside ``state`` (padding rows, when value checks are off)
    neither read nor write the ring."""
    op = "compress_tokens"
    check_compress_tokens(latent, positions, state_slots, chunk_start, ratio)
    for name, value in (("latent", latent), ("positions", positions), ("state_slots", state_slots),
                        ("chunk_start", chunk_start)):
        require(on_device(value), op, f"{name} must be a CUDA tensor, got one on {value.device}")
    if ratio > 1:
        check_compress_state(latent, score, state_slots, state, ratio)
        require(on_device(score) and on_device(state), op, "score and state must be CUDA tensors")
        require(state.is_contiguous(), op, f"state must be contiguous (it is written in place), got strides "
                                           f"{state.stride()}")
        if value_checks():
            _check_groups(positions, state_slots, chunk_start, ratio)
    import triton
    from deepinfer_backends.sm100.fused.compress import BLOCK_CHANNELS, compress_pool_kernel, compress_store_kernel

    tokens, dim = latent.shape
    out = torch.empty(tokens, dim, dtype=torch.bfloat16, device=latent.device)
    emit = torch.empty(tokens, dtype=torch.bool, device=latent.device)
    if not tokens:
        return out, emit
    block = min(triton.next_power_of_2(max(dim, 1)), BLOCK_CHANNELS)
    grid = (tokens, max(1, triton.cdiv(dim, block)))
    latent, positions, state_slots = latent.contiguous(), positions.contiguous(), state_slots.contiguous()
    score = latent if ratio == 1 else score.contiguous()
    ring = latent if ratio == 1 else state
    num_slots, ring_length = (0, 1) if ratio == 1 else state.shape[:2]
    compress_pool_kernel[grid](latent, score, ring, positions, state_slots, chunk_start.contiguous(), out,
                               emit.view(torch.int8), dim, num_slots, ring_length, RATIO=ratio, BLOCK=block,
                               num_warps=4)
    if ratio > 1:
        compress_store_kernel[grid](latent, score, state, positions, state_slots, tokens, dim, num_slots, ring_length,
                                    BLOCK=block, num_warps=4)
    return out, emit


def _check_groups(positions, state_slots, chunk_start, ratio) -> None:
    """The reference's check that each closing token's in-call members are the rows before it."""
    back = torch.arange(ratio - 1, -1, -1, device=positions.device)
    member_positions = positions[:, None] - back
    in_call = member_positions >= chunk_start[:, None]
    call_rows = torch.arange(positions.shape[0], device=positions.device)[:, None] - back
    rows = ((positions + 1) % ratio == 0).nonzero().squeeze(1)
    check_contiguous(call_rows[rows], in_call[rows], member_positions[rows], positions, state_slots,
                      state_slots[rows])
