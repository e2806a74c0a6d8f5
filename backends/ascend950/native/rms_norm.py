"""Native ascend950 RMSNorm: bf16 rows padded to whole tiles of the emulation's
:func:`~deepinfer_backends.ascend950.emulate.rms_norm.row_tile`, normalised by
:mod:`~deepinfer_backends.ascend950.kernels.rms_norm` with that plan's offsets. The kernel always
adds a residual (written back in place into a copy); without one it adds zeros, which leaves
bf16 rows exactly as they are."""
from __future__ import annotations

import torch

from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate.rms_norm import plan_buffers, row_tile
from deepinfer_backends.ascend950.native.launch import (Kernels, check_device, padded, plan_offsets, refuse, round_up,
                                                       whole)

OP = "rms_norm"


def rms_norm(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """:func:`deepinfer.hal.ops.norm.rms_norm` on the NPU for bf16 rows (and a bf16 residual)."""
    if x.dtype != torch.bfloat16:
        raise refuse(OP, f"the kernel normalises bf16 rows, got {x.dtype}")
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        raise refuse(OP, f"the kernel adds a residual of x's dtype and shape ({x.dtype} {tuple(x.shape)}), got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    dim = x.shape[-1]
    if dim * x.element_size() % 32:
        raise refuse(OP, f"the kernel moves rows in 32-byte blocks: a row of {dim} bf16 values is not a multiple "
                         f"of 32 B")
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] (the norm over x's last dim), got {tuple(weight.shape)}")
    check_device(OP, x=x, weight=weight, residual=residual)
    flat = x.reshape(-1, dim)
    rows = flat.shape[0]
    if rows == 0:
        return (torch.empty_like(x), residual.clone()) if residual is not None else torch.empty_like(x)
    platform = kernels.platform
    tile = row_tile(dim, x.element_size(), platform)
    whole_rows = round_up(rows, tile)
    kernel = kernels.get(OP, dict(rows=whole_rows, dim=dim, tile_rows=tile, vector_cores=2 * AI_CORES[platform],
                                  eps=float(eps), offsets=plan_offsets(OP, plan_buffers(tile, dim, 2), platform),
                                  dtype="bfloat16"), out_idx=[3])
    stream = torch.zeros(whole_rows, dim, dtype=x.dtype, device=x.device) if residual is None else \
        padded(residual.reshape(-1, dim), (whole_rows, dim))
    out = kernel(whole(flat, (whole_rows, dim)), stream, weight.float().reshape(1, dim).contiguous())
    normed = out[:rows].view(x.shape)
    return (normed, stream[:rows].view(residual.shape)) if residual is not None else normed
