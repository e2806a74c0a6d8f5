"""Native ascend950 grouped GEMM: bf16 or float32 operands through
:mod:`~deepinfer_backends.ascend950.kernels.grouped_gemm`, FP8 x FP8 (UE8M0 scales per 32 along
K) through :mod:`~deepinfer_backends.ascend950.kernels.grouped_gemm_fp8`, with the emulation's
tiles (:data:`~deepinfer_backends.ascend950.emulate.grouped_gemm.TILES`). The kernels take every
expert's segment at one length, so the segment sizes are read on the host: each expert's rows
move to a segment of the longest one's rows rounded up to ``base_m``, N and K are padded with
zeros to whole tiles (FP8 scale bytes with 127, a factor of one), and the results move back to
the rows they came from; rows after the last segment are zero."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_gemm import check_grouped_gemm, check_grouped_out_dtype
from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate.grouped_gemm import SCALE_BLOCK, TILES, pack_scales
from deepinfer_backends.ascend950.native.launch import Kernels, check_device, plan_offsets, refuse, round_up, whole

OP = "grouped_gemm"
UNITY_SCALE = 127
"""The UE8M0 byte of 2^0, which the padded K blocks carry."""


def grouped_gemm(kernels: Kernels, x, weight, group_sizes: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`deepinfer.hal.ops.grouped_gemm.grouped_gemm` on the NPU for bf16 x bf16, float32 x
    float32 and FP8 x FP8 operands (a bf16 ``out_dtype`` rounds the kernel's float32 result afterwards)."""
    check_grouped_gemm(x, weight, group_sizes)
    result_dtype = check_grouped_out_dtype(x, weight, out_dtype)
    quantized = isinstance(x, Quantized) or isinstance(weight, Quantized)
    if quantized and not (isinstance(x, Quantized) and isinstance(weight, Quantized) and x.fmt == weight.fmt == "fp8"):
        raise refuse(OP, f"the kernels take FP8 x FP8 or plain bf16/float32 operands, got x {_kind(x)} and weight "
                         f"{_kind(weight)} (the 950's cube has no FP4 path and no mixed GEMM)")
    if not quantized and (x.dtype not in TILES or weight.dtype != x.dtype):
        raise refuse(OP, f"the kernels take bf16 x bf16 or float32 x float32 operands, got x {x.dtype} and "
                         f"weight {weight.dtype}")
    x_data, w_data = (x.data, weight.data) if quantized else (x, weight)
    check_device(OP, x=x_data, weight=w_data, group_sizes=group_sizes)
    rows, k = x_data.shape
    experts, n = w_data.shape[0], w_data.shape[1]
    out_dtype = torch.float32 if quantized else x.dtype
    result = torch.zeros(rows, n, dtype=out_dtype, device=x_data.device)
    sizes = group_sizes.tolist()
    total = sum(sizes)
    if total == 0:
        return result.to(result_dtype)
    tiles = TILES["fp8" if quantized else x.dtype]
    segment = round_up(max(sizes), tiles.base_m)
    n_whole, k_whole = round_up(n, tiles.base_n), round_up(k, tiles.base_k * tiles.stages)
    expert = torch.repeat_interleave(torch.arange(experts, device=group_sizes.device), group_sizes,
                                     output_size=total)
    starts = torch.cumsum(group_sizes, 0) - group_sizes
    destination = (expert * segment + torch.arange(total, device=group_sizes.device) - starts[expert]).to(x_data.device)
    shape = dict(experts=experts, segment_rows=segment, n=n_whole, k=k_whole, base_m=tiles.base_m,
                 base_n=tiles.base_n, base_k=tiles.base_k, stages=tiles.stages, cores=AI_CORES[kernels.platform])
    if quantized:
        offsets = plan_offsets(OP, tiles.fp8_buffers(k_whole), kernels.platform)
        kernel = kernels.get("grouped_gemm_fp8", dict(shape, offsets=offsets), out_idx=[5], workspace_idx=[4])
        blocks = k_whole // SCALE_BLOCK
        x_bytes = _segments(x.data.view(torch.uint8)[:total], destination, experts * segment, k_whole, 0)
        x_scale = _segments(x.scale[:total], destination, experts * segment, blocks, UNITY_SCALE)
        out = kernel(x_bytes.view(torch.float8_e4m3fn), pack_scales(x_scale),
                     whole(weight.data.view(torch.uint8), (experts, n_whole, k_whole)).view(torch.float8_e4m3fn),
                     pack_scales(whole(weight.scale, (experts, n_whole, blocks), UNITY_SCALE)))
    else:
        dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
        offsets = plan_offsets(OP, tiles.buffers(x.element_size()), kernels.platform)
        kernel = kernels.get(OP, dict(shape, offsets=offsets, dtype=dtype), out_idx=[3], workspace_idx=[2])
        out = kernel(_segments(x[:total], destination, experts * segment, k_whole, 0),
                     whole(weight, (experts, n_whole, k_whole)))
    result[:total] = out[destination, :n]
    return result.to(result_dtype)


def _segments(values: torch.Tensor, destination: torch.Tensor, rows: int, cols: int, fill: int) -> torch.Tensor:
    """``values`` (a row per entry of ``destination``) placed at rows ``destination`` of a
    ``[rows, cols]`` tensor of ``fill``."""
    out = torch.full((rows, cols), fill, dtype=values.dtype, device=values.device)
    out[destination, :values.shape[1]] = values
    return out


def _kind(operand) -> str:
    return operand.fmt if isinstance(operand, Quantized) else str(operand.dtype).replace("torch.", "")
