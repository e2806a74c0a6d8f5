"""sm100 SWA ring addressing (``swa_ring_slots``, ``swa_decode_indices``, ``swa_prefill_indices``,
``swa_history_slots``): one Triton launch each (:mod:`.fused.swa_indices`)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.swa_replay import (
    check_after_chunk_start, check_index_vectors, check_positive, check_window,
)
from deepinfer.hal.value_checks import value_checks
from deepinfer_backends.sm100.launch import on_device, require


def swa_ring_slots(state_slots, positions, ring_size):
    """HAL ``swa_ring_slots`` for CUDA vectors: flat ring rows ``int64 [n]``, ``-1`` for padding
    rows and negative positions."""
    check_index_vectors(state_slots=state_slots, positions=positions)
    check_positive(ring_size=ring_size)
    _require_on_device("swa_ring_slots", state_slots=state_slots, positions=positions)
    out = torch.empty(positions.shape[0], 1, dtype=torch.int64, device=positions.device)
    _ring_window(out, state_slots, positions, None, 0, ring_size)
    return out.view(-1)


def swa_decode_indices(state_slots, positions, window, ring_size, visible_start=None):
    """HAL ``swa_decode_indices`` for CUDA vectors: ``int32 [T, window]`` ring rows of each
    query's window keys, ``-1`` for keys it does not see."""
    check_index_vectors(state_slots=state_slots, positions=positions, visible_start=visible_start)
    check_window(window, ring_size)
    _require_on_device("swa_decode_indices", state_slots=state_slots, positions=positions,
                       visible_start=visible_start)
    out = torch.empty(positions.shape[0], window, dtype=torch.int32, device=positions.device)
    _ring_window(out, state_slots, positions, visible_start, 1 - window, ring_size)
    return out


def swa_history_slots(state_slots, chunk_start, window, ring_size):
    """HAL ``swa_history_slots`` for CUDA vectors: ``int64 [B, window - 1]`` ring rows of the
    keys before each chunk, ``-1`` for negative positions."""
    check_index_vectors(state_slots=state_slots, chunk_start=chunk_start)
    check_window(window, ring_size)
    _require_on_device("swa_history_slots", state_slots=state_slots, chunk_start=chunk_start)
    out = torch.empty(chunk_start.shape[0], window - 1, dtype=torch.int64, device=chunk_start.device)
    _ring_window(out, state_slots, chunk_start, None, 1 - window, ring_size)
    return out


def swa_prefill_indices(positions, chunk_start, history_offset, chunk_offset, window, visible_start=None):
    """HAL ``swa_prefill_indices`` for CUDA vectors: ``int32 [T, window]`` rows of each query's
    window keys in the gathered ``[history | chunk]`` buffer, ``-1`` for keys it does not see."""
    vectors = dict(positions=positions, chunk_start=chunk_start, history_offset=history_offset,
                   chunk_offset=chunk_offset, visible_start=visible_start)
    check_index_vectors(**vectors)
    check_positive(window=window)
    if value_checks():
        check_after_chunk_start(positions, chunk_start)
    _require_on_device("swa_prefill_indices", **vectors)
    from deepinfer_backends.sm100.fused.swa_indices import prefill_window_kernel

    out = torch.empty(positions.shape[0], window, dtype=torch.int32, device=positions.device)
    if out.numel():
        grid, blocks = _tiles(*out.shape)
        prefill_window_kernel[grid](
            positions.contiguous(), chunk_start.contiguous(), history_offset.contiguous(), chunk_offset.contiguous(),
            _vector_or(visible_start, positions), out, out.shape[0], window, HAS_VISIBLE=visible_start is not None,
            **blocks, num_warps=4)
    return out


def _ring_window(out, state_slots, anchors, visible_start, first_offset, ring_size) -> None:
    """Fill ``out [n, count]`` with the ring rows of key positions ``anchors + first_offset + j``."""
    if not out.numel():
        return
    from deepinfer_backends.sm100.fused.swa_indices import ring_window_kernel

    grid, blocks = _tiles(*out.shape)
    ring_window_kernel[grid](
        state_slots.contiguous(), anchors.contiguous(), _vector_or(visible_start, anchors), out, out.shape[0],
        out.shape[1], first_offset, ring_size, HAS_VISIBLE=visible_start is not None, **blocks, num_warps=4)


def _tiles(rows: int, keys: int):
    """The launch grid over ``[rows, keys]`` and its block constexprs."""
    import triton
    from deepinfer_backends.sm100.fused.swa_indices import BLOCK_ELEMENTS, MAX_BLOCK_KEYS

    block_keys = min(triton.next_power_of_2(keys), MAX_BLOCK_KEYS)
    block_rows = BLOCK_ELEMENTS // block_keys
    return (triton.cdiv(rows, block_rows), triton.cdiv(keys, block_keys)), \
        {"BLOCK_ROWS": block_rows, "BLOCK_KEYS": block_keys}


def _vector_or(vector: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``vector`` (contiguous), or ``stand_in`` for a kernel argument it does not read."""
    return stand_in if vector is None else vector.contiguous()


def _require_on_device(op: str, **vectors: torch.Tensor | None) -> None:
    for name, vector in vectors.items():
        if vector is not None:
            require(on_device(vector), op, f"{name} must be a CUDA tensor, got one on {vector.device}")
