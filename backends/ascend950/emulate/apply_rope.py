"""Emulated ascend950 RoPE: token rows spread over the vector cores in UB tiles; each tile's
trailing ``R`` dims turn in float32 by its tokens' angles (interleaved pairs, conjugate to undo)
and are rounded once to the rows' dtype."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.rope import apply_rope as reference_rope
from deepinfer.hal.ops.rope import check_rope_args
from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate.plan import run_row_tiles
from deepinfer_backends.ascend950.emulate.rms_norm import row_tile


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, conjugate: bool = False,
               out: torch.Tensor | None = None, platform: str = "A5") -> torch.Tensor:
    """:func:`deepinfer.hal.ops.rope.apply_rope` as the ascend950 kernel plans it: the rows are
    each token's heads (``x [T, ..., D]`` viewed as ``[T * heads, D]``), so a tile never holds more
    than the UB takes whatever the head count."""
    check_rope_args(x, positions, cos_sin, out)
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    heads = flat.shape[0] // max(x.shape[0], 1)
    result = torch.empty_like(flat)

    def turn(first: int, end: int) -> None:
        tokens = torch.arange(first, end, device=positions.device) // heads
        result[first:end] = reference_rope(flat[first:end], positions[tokens], cos_sin, conjugate)
    run_row_tiles(flat.shape[0], row_tile(dim, x.element_size(), platform), 2 * AI_CORES[platform], turn)
    result = result.view(x.shape)
    return result if out is None else out.copy_(result)
