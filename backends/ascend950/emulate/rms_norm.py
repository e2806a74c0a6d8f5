"""Emulated ascend950 RMSNorm: rows spread over the vector cores (two an AI core) in tiles that
fit the unified buffer, computed in float32 and rounded once as they are copied out. The order in
which the vector unit sums a row's squares is not modelled (PyTorch's is used): quantized stores
downstream (FP4 codes) would flip on a last-bit difference that no CPU run can vouch for."""
from __future__ import annotations

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer_backends.ascend950.buffers import AI_CORES, KIB, Buffer, layout
from deepinfer_backends.ascend950.emulate.plan import run_row_tiles

def plan_buffers(rows: int, dim: int, element: int) -> tuple[Buffer, ...]:
    """A vector core's UB buffers for tiles of ``rows`` rows, in layout order: input rows (the
    output is rounded into the input's slot) and residual rows, both double-buffered, the float32
    working and squares tiles, the float32 weight row, the per-row scale and the row reduction's
    scratch (half a float32 tile). The native kernel,
    :mod:`~deepinfer_backends.ascend950.kernels.rms_norm`, places its buffers at these offsets."""
    return (Buffer("rows_in", "UB", rows * dim * element, copies=2),
            Buffer("residual", "UB", rows * dim * element, copies=2),
            Buffer("work", "UB", rows * dim * 4), Buffer("squares", "UB", rows * dim * 4),
            Buffer("weight", "UB", dim * 4), Buffer("scale", "UB", rows * 4),
            Buffer("reduce_scratch", "UB", rows * dim * 2))


def row_tile(dim: int, element: int, platform: str = "A5") -> int:
    """Rows a vector core's UB tile holds: :func:`plan_buffers` in at most half the UB (one row
    at least, as long as that fits the whole UB)."""
    per_row = dim * (2 * element * 2 + 10) + 4
    rows = max(1, (128 * KIB - dim * 4) // per_row)
    layout(plan_buffers(rows, dim, element), platform)
    return rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             platform: str = "A5"):
    """:func:`deepinfer.hal.ops.norm.rms_norm` as the ascend950 kernel plans it."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise UnsupportedInput(f"ascend950 rms_norm takes bf16 or float32 rows, got {x.dtype}")
    dim = x.shape[-1]
    if dim * x.element_size() % 32:
        raise UnsupportedInput(f"ascend950 rms_norm moves rows in 32-byte blocks: a row of {dim} x "
                               f"{x.element_size()} B is not a multiple of 32 B")
    flat = x.reshape(-1, dim)
    summed = flat.float()
    if residual is not None:  # the new residual stream, rounded; the norm reads the rounded sum
        summed = (summed + residual.reshape(-1, dim).float()).to(residual.dtype).float()
    out = torch.empty_like(flat)
    w = weight.float()

    def normalise(first: int, end: int) -> None:
        tile = summed[first:end]
        out[first:end] = (tile * torch.rsqrt(tile.pow(2).mean(dim=-1, keepdim=True) + eps) * w).to(x.dtype)
    run_row_tiles(flat.shape[0], row_tile(dim, x.element_size(), platform), 2 * AI_CORES[platform], normalise)
    normed = out.view(x.shape)
    return (normed, summed.to(residual.dtype).view(residual.shape)) if residual is not None else normed
