"""sm100 ``grouped_swiglu``: the gate and up weights streamed side by side, the SwiGLU applied
before the store, in one launch: by the Triton kernel for few rows per expert, by the
warp-specialised TileLang kernel (:mod:`.kernels.grouped_swiglu`) for more on Hopper; otherwise
the two grouped GEMMs and the SwiGLU kernel, as the composition the op stands for."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_swiglu import check_grouped_swiglu
from deepinfer_backends.sm100.activation import swiglu
from deepinfer_backends.sm100 import toolchain
from deepinfer_backends.sm100.gemm import (SKINNY_BF16_ROWS_PER_EXPERT, WS_STAGES, gemm_tiles, grouped_gemm,
                                           grouped_gemm_few_rows, shared_schedule)
from deepinfer_backends.sm100.launch import compiled, cuda_bf16
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions


def grouped_swiglu(x, w1, w3, group_sizes: torch.Tensor, limit, dtype=None, batch_invariant: bool = False,
                   options: KernelOptions = DEFAULT) -> torch.Tensor:
    """HAL ``grouped_swiglu``. bf16 operands with at most :data:`SKINNY_BF16_ROWS_PER_EXPERT` rows
    per expert on average (outside the batch-invariant mode and ``options.tcgen05``) take the gated
    :mod:`.fused.grouped_gemm_skinny` kernel, more rows the fused TileLang kernel where
    :func:`fused_grouped_swiglu` serves (bf16 result); everything else :func:`grouped_gemm` twice
    (one tile schedule for both) and :func:`swiglu`, with the same ``batch_invariant`` and ``options``."""
    check_grouped_swiglu(x, w1, w3, limit)
    fused = not any(isinstance(t, Quantized) for t in (x, w1, w3)) and not batch_invariant and not options.tcgen05
    if fused:
        for name, t in (("x", x), ("w1", w1), ("w3", w3)):
            cuda_bf16("grouped_swiglu", name, t)
    if fused and x.dim() == 2 and w1.dim() == 3 and x.shape[0] <= SKINNY_BF16_ROWS_PER_EXPERT * w1.shape[0]:
        if not _segments_fit(x, w1, group_sizes):
            raise ValueError(f"grouped_swiglu expects x [M, K], weights [E, N, K] and int64 group_sizes [E]; got x "
                             f"{tuple(x.shape)}, w1 {tuple(w1.shape)}, group_sizes {group_sizes.dtype} "
                             f"{tuple(group_sizes.shape)}")
        return grouped_gemm_few_rows(x.contiguous(), w1.contiguous(), group_sizes, up=w3.contiguous(), limit=limit,
                                     dtype=dtype)
    if fused and dtype in (None, torch.bfloat16) and _segments_fit(x, w1, group_sizes):
        y = fused_grouped_swiglu(x, w1, w3, group_sizes, limit)
        if y is not None:
            return y
    gate = grouped_gemm(x, w1, group_sizes, batch_invariant=batch_invariant, options=options)
    up = grouped_gemm(x, w3, group_sizes, batch_invariant=batch_invariant, options=options)
    return swiglu(gate, up, limit, dtype)


FUSED_BLOCK_N = 128
"""Output columns a CTA of the fused kernel computes (gate and up: twice as many products)."""


def _segments_fit(x, w1, group_sizes: torch.Tensor) -> bool:
    """``x [M, K]``, ``w1 [E, N, K]`` and int64 ``group_sizes [E]``."""
    return x.dim() == 2 and w1.dim() == 3 and w1.shape[2] == x.shape[1] and group_sizes.dtype == torch.int64 \
        and tuple(group_sizes.shape) == (w1.shape[0],)


def fused_grouped_swiglu(x, w1, w3, group_sizes: torch.Tensor, limit) -> torch.Tensor | None:
    """The ``grouped_swiglu`` of CUDA bf16 ``x [M, K]``, ``w1``, ``w3 [E, N, K]`` and int64
    ``group_sizes [E]`` by :func:`~.kernels.grouped_swiglu.grouped_swiglu_bf16_ws`, on a Hopper
    GPU, for ``N`` a multiple of :data:`FUSED_BLOCK_N` and ``K`` of 8 (16-byte rows for TMA); None
    where it does not serve. The tile rows and the schedule are the grouped GEMM's
    (:func:`~.gemm.gemm_tiles`, :func:`~.gemm.shared_schedule`)."""
    experts, n, k = w1.shape
    if n % FUSED_BLOCK_N or k % 8 or toolchain.device_arch(x.device.index or 0) != toolchain.HOPPER:
        return None
    block_m = gemm_tiles(x.shape[0], experts, n, k)["block_m"]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        schedule = shared_schedule(group_sizes, x.shape[0], block_m, x.device)
        kernel = compiled("grouped_swiglu", "grouped_swiglu_bf16_ws", experts, n, k,
                          None if limit is None else float(limit), block_m=block_m, block_n=FUSED_BLOCK_N,
                          num_stages=WS_STAGES)
        kernel(x.contiguous(), w1.contiguous(), w3.contiguous(), schedule[0], schedule[1], schedule[2], y)
    return y
