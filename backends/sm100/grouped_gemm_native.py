"""``grouped_gemm`` on Hopper's FP8 tensor cores (``backend.options.quant_gemm=native``): FP8
activations x FP8 or MXFP4 expert weights through :mod:`.kernels.grouped_gemm_fp8_k128`, with the
operands' UE8M0 scales per 32 along K moved to the kernel's granularity (see that option for
the numbers it gives)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer_backends.sm100 import toolchain
from deepinfer_backends.sm100.fp8_scales import BLOCK_M, GROUP, aligned
from deepinfer_backends.sm100.gemm import SKINNY_ROWS_PER_EXPERT, shared_schedule
from deepinfer_backends.sm100.launch import compiled, param_copy, require

DEEP_K = 4096
"""Reduction depth from which the native kernel takes its wider tile."""


def native_tiles(k: int) -> dict:
    """Tiles of the native FP8 grouped GEMM (128 rows a tile) for reduction depth ``k``: 208 columns
    from ``DEEP_K`` on, else 192, the faster of the two on each side on an H100
    (``experiments/results/grouped_gemm_fp8_k128_h100.md``). Either keeps a promoted accumulator
    and a partial of at most 104 registers each."""
    return {"block_n": 208 if k >= DEEP_K else 192}


def native_fits(x, rows: int, experts: int, k: int, arch: str, batch_invariant: bool, tcgen05: bool) -> bool:
    """Whether ``quant_gemm=native`` takes the FP8 tensor cores for ``x [rows, k]`` on a GPU of
    ``arch``: FP8 activations on Hopper, ``k`` a positive multiple of 128, more than
    ``SKINNY_ROWS_PER_EXPERT`` rows per expert on average (fewer stream the weights, which the
    exact kernel for few rows does as fast), outside the batch-invariant mode and ``tcgen05``."""
    return (isinstance(x, Quantized) and arch == toolchain.HOPPER and not batch_invariant and not tcgen05
            and k > 0 and k % GROUP == 0 and rows > SKINNY_ROWS_PER_EXPERT * experts)


def grouped_gemm_native(x: Quantized, weight: Quantized, group_sizes: torch.Tensor, op: str = "grouped_gemm",
                        schedules: dict | None = None) -> torch.Tensor:
    """``grouped_gemm`` of FP8 ``x`` and ``weight`` (checked by the caller) on the native kernel, float32
    result: the activations' scales moved to one per 128 along K and gathered per tile by
    :func:`~.fused.align_fp8.align_fp8` every call, the weights' to one per output column once per
    parameter (:func:`~.launch.param_copy` keyed by the data; e4m3 copies, so MXFP4 weights take
    twice their bytes again)."""
    from deepinfer_backends.sm100.fused.align_fp8 import align_fp8
    from deepinfer_backends.sm100.kernels import grouped_gemm_fp8_k128 as native

    tensors = (x.data, x.scale, weight.data, weight.scale)
    require(all(t.is_cuda for t in tensors), op,
            f"operands must be CUDA tensors, got {[str(t.device) for t in tensors]}")
    w, w_scale = param_copy(weight.data, "fp8_k128_columns", lambda _: aligned(weight, group=None))
    rows = x.data.shape[0]
    y = torch.empty(rows, w.shape[1], dtype=torch.float32, device=x.data.device)
    if rows:
        schedule = shared_schedule(group_sizes, rows, BLOCK_M, x.data.device, schedules)
        x_data, x_scale = align_fp8(x.data, x.scale, schedule)
        compiled(native.MODULE, "grouped_gemm_fp8_k128", *w.shape, **native_tiles(w.shape[2]))(
            x_data, x_scale, w, w_scale, schedule[0], schedule[1], schedule[2], y)
    return y
