"""Emulated ascend950 RoPE: token rows (a token's heads are consecutive rows) spread over the
vector cores in UB tiles of :func:`row_tile` rows; each tile's trailing ``R`` dims turn in float32
by its tokens' angles (interleaved pairs, conjugate to undo) and are rounded once to the rows'
dtype. The native kernel, :mod:`~deepinfer_backends.ascend950.kernels.apply_rope`, runs this plan."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.rope import apply_rope as reference_rope
from deepinfer.hal.ops.rope import check_rope_args
from deepinfer_backends.ascend950.buffers import AI_CORES, KIB, Buffer, rows_that_fit
from deepinfer_backends.ascend950.emulate.plan import run_row_tiles

GATHER_SCRATCH = 32
"""UB bytes the lowering takes for a gather's scratch."""


def rope_buffers(rows: int, rope_dim: int) -> tuple[Buffer, ...]:
    """The rotation's float32 and uint32 ``[rows, R]`` UB buffers for tiles of ``rows`` rows, shared
    by both RoPE kernels, in layout order: the rotated dims, each value's pair partner, each pair's
    cos twice, its signed sin twice, the tile's gathered ``cos_sin`` rows, the byte offsets the
    three gathers read (built once a launch) and the signs (``-1`` on each pair's first value,
    ``+1`` on its second; swapped to conjugate). A gather takes whole buffers, so each of its
    operands is a buffer of its own."""
    tile = rows * rope_dim * 4
    names = ("rope", "partner", "cos", "sin", "table", "swap_offsets", "cos_offsets", "sin_offsets", "sign")
    return tuple(Buffer(name, "UB", tile) for name in names)


def plan_buffers(rows: int, rope_dim: int, element: int) -> tuple[Buffer, ...]:
    """A vector core's UB buffers for tiles of ``rows`` rows, in layout order: the rows' rotated
    dims (``rope_in``, double-buffered; the result is rounded into the same slot), then
    :func:`rope_buffers`; the gathers' scratch follows them."""
    return (Buffer("rope_in", "UB", rows * rope_dim * element, copies=2), *rope_buffers(rows, rope_dim),
            Buffer("gather_scratch", "UB", GATHER_SCRATCH))


def row_tile(rope_dim: int, element: int, platform: str = "A5") -> int:
    """Rows a vector core's UB tile holds: :func:`plan_buffers` in at most half the UB."""
    return rows_that_fit(lambda rows: plan_buffers(rows, rope_dim, element), 128 * KIB, platform)


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
    run_row_tiles(flat.shape[0], row_tile(cos_sin.shape[1], x.element_size(), platform), 2 * AI_CORES[platform],
                  turn)
    result = result.view(x.shape)
    return result if out is None else out.copy_(result)
