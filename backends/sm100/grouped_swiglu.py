"""sm100 ``grouped_swiglu``: the gate and up weights streamed side by side by the Triton kernel
for few rows per expert, the SwiGLU applied before the store (one tile schedule, one launch);
otherwise the two grouped GEMMs and the SwiGLU kernel, as the composition the op stands for."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_swiglu import check_grouped_swiglu
from deepinfer_backends.sm100.activation import swiglu
from deepinfer_backends.sm100.gemm import SKINNY_BF16_ROWS_PER_EXPERT, grouped_gemm, grouped_gemm_few_rows
from deepinfer_backends.sm100.launch import cuda_bf16
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions


def grouped_swiglu(x, w1, w3, group_sizes: torch.Tensor, limit, dtype=None, batch_invariant: bool = False,
                   options: KernelOptions = DEFAULT) -> torch.Tensor:
    """HAL ``grouped_swiglu``. bf16 operands with at most :data:`SKINNY_BF16_ROWS_PER_EXPERT` rows
    per expert on average (outside the batch-invariant mode and ``options.tcgen05``) take the gated
    :mod:`.fused.grouped_gemm_skinny` kernel; everything else :func:`grouped_gemm` twice (one tile
    schedule for both) and :func:`swiglu`, with the same ``batch_invariant`` and ``options``."""
    check_grouped_swiglu(x, w1, w3, limit)
    plain = not any(isinstance(t, Quantized) for t in (x, w1, w3))
    if plain and not batch_invariant and not options.tcgen05 and x.dim() == 2 and w1.dim() == 3 \
            and x.shape[0] <= SKINNY_BF16_ROWS_PER_EXPERT * w1.shape[0]:
        for name, t in (("x", x), ("w1", w1), ("w3", w3)):
            cuda_bf16("grouped_swiglu", name, t)
        if w1.shape[2] != x.shape[1] or group_sizes.dtype != torch.int64 or tuple(group_sizes.shape) != (w1.shape[0],):
            raise ValueError(f"grouped_swiglu expects x [M, K], weights [E, N, K] and int64 group_sizes [E]; got x "
                             f"{tuple(x.shape)}, w1 {tuple(w1.shape)}, group_sizes {group_sizes.dtype} "
                             f"{tuple(group_sizes.shape)}")
        return grouped_gemm_few_rows(x.contiguous(), w1.contiguous(), group_sizes, up=w3.contiguous(), limit=limit,
                                     dtype=dtype)
    gate = grouped_gemm(x, w1, group_sizes, batch_invariant=batch_invariant, options=options)
    up = grouped_gemm(x, w3, group_sizes, batch_invariant=batch_invariant, options=options)
    return swiglu(gate, up, limit, dtype)
