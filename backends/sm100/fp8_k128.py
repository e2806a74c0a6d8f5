"""Block-scaled ``grouped_gemm`` on Hopper's native FP8 wgmma (``backend.options.fp8_grouped_gemm=native_k128``).

Hopper's FP8 tensor cores take no per-block scales, so every scale costs a promotion of the
float32 partial on the CUDA cores; with the HAL's UE8M0 scales per 32 along K that promotion
outweighs the tensor cores (``kernels/experimental/grouped_gemm_fp8_wgmma.py``). This path moves
both operands to one scale per 128 along K (DeepGEMM's SM90 granularity) and runs
``kernels/grouped_gemm_fp8_k128.py``:

- e4m3 operands keep their bytes where a 128-value group's four scales agree; otherwise each
  32-value block is multiplied by ``2 ** (its exponent - the group's largest)`` and rounded to
  e4m3 (:func:`~deepinfer_backends.sm100.kernels.grouped_gemm_fp8_k128.align_reference`): exact
  for values that stay in e4m3's normal range, a rounding for smaller ones;
- MXFP4 weights become e4m3 (the e2m1 value times 2^6), exact while a group's scales span at most
  14 binades;
- bf16 activations are first cast to e4m3 with UE8M0 scales per 32 as DeepInfer casts them
  (:func:`deepinfer.hal.formats.quantize`): an FP8 W8A8 GEMM, no longer the exact decode.

Activations are aligned per call by one Triton launch (:mod:`.fused.fp8_k128_align`).

Weights are aligned once per parameter (:func:`~deepinfer_backends.sm100.launch.param_copy`);
e4m3 weights then take a second copy of their bytes, MXFP4 ones twice theirs."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer_backends.sm100.kernels.grouped_gemm_fp8_k128 import GROUP, align_reference
from deepinfer_backends.sm100.launch import compiled, param_copy

TILES = {"block_m": 128, "block_n": 128, "threads": 256, "num_stages": 4}
"""Tiles of the kernel: two consumer warpgroups of 64 rows, each holding its float32 partial and
accumulator (128 registers a thread) under ``setmaxnreg``."""
MXFP4_SHIFT = 6
"""The e2m1 values are held as e4m3 times ``2 ** MXFP4_SHIFT`` (6 x 64 = 384 <= 448)."""
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def eligible(x, weight, k: int) -> bool:
    """Whether this path can serve the operands: an ``fp8``/``mxfp4`` weight, bf16 or ``fp8`` x,
    scales per 32, K a multiple of 128."""
    if not isinstance(weight, Quantized) or weight.fmt not in ("fp8", "mxfp4") or weight.block != 32:
        return False
    if isinstance(x, Quantized) and (x.fmt != "fp8" or x.block != 32):
        return False
    return k % GROUP == 0


def aligned(q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., k], float32 scale [..., k/128])`` of an ``fp8`` or ``mxfp4`` operand with UE8M0
    scales per 32 (byte 0 reads as a zero block, as in the other block-scaled kernels)."""
    scale = q.scale.to(torch.int32)
    if q.fmt == "mxfp4":
        table = torch.tensor(_E2M1, device=q.data.device) * 2.0 ** MXFP4_SHIFT
        codes = torch.stack((q.data & 15, q.data >> 4), dim=-1).flatten(-2).long()
        values, exponents = table[codes], scale - 127 - MXFP4_SHIFT
    else:
        values, exponents = q.data.float(), scale - 127
    values = values.unflatten(-1, (-1, 32)).masked_fill((scale == 0).unsqueeze(-1), 0.0).flatten(-2)
    data, group_scale = align_reference(values, exponents)
    return data.contiguous(), group_scale.contiguous()


def aligned_weight(weight: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`aligned` of an expert weight ``[experts, n, k]``, scales K-group-major
    ``[experts, k/128, n]`` as the kernel reads them, made once per parameter."""
    def convert(_):
        data, scale = aligned(weight)
        return data, scale.transpose(-1, -2).contiguous()

    return param_copy(weight.data, f"k128:{weight.fmt}", convert)


def grouped_gemm_k128(x, weight: Quantized, group_sizes: torch.Tensor, schedule_of) -> torch.Tensor:
    """float32 ``y [m, n]`` of ``x`` (bf16, or Quantized ``fp8``) and ``weight`` by the native FP8
    kernel; ``schedule_of(tile_rows)`` gives the tile schedule."""
    from deepinfer_backends.sm100.fused.fp8_k128_align import align_rows

    x_data, x_scale = align_rows(x.data, x.scale) if isinstance(x, Quantized) else align_rows(x, None)
    w_data, w_scale = aligned_weight(weight)
    y = torch.empty(x_data.shape[0], w_data.shape[1], dtype=torch.float32, device=x_data.device)
    if x_data.shape[0]:
        kernel = compiled("grouped_gemm_fp8_k128", "grouped_gemm_fp8_k128", *w_data.shape, **TILES)
        kernel(x_data, x_scale, w_data, w_scale, *schedule_of(TILES["block_m"]), y)
    return y
