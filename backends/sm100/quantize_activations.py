"""sm100 ``quantize_activations``: one Triton pass (:mod:`.fused.quantize_activations`)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.quantize_activations import check_quantize_activations
from deepinfer_backends.sm100.launch import on_device, require


def quantize_activations(x, fmt: str = "fp8", row_scale=None) -> Quantized:
    """HAL ``quantize_activations`` of a CUDA bf16 or float32 ``x [..., K]`` (each row times its
    ``row_scale`` first, when given): the reference's e4m3 codes and UE8M0 bytes."""
    op = "quantize_activations"
    check_quantize_activations(x, fmt, row_scale)
    require(on_device(x), op, f"x must be a CUDA tensor, got {x.device}")
    require(x.dtype in (torch.bfloat16, torch.float32), op, f"x must be bf16 or float32, got {x.dtype}")
    from deepinfer_backends.sm100.fused.quantize_activations import BLOCK, BLOCK_K, BLOCK_ROWS, \
        quantize_activations_kernel

    k = x.shape[-1]
    flat = x.reshape(-1, k) if k else x.reshape(0, 0)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    data = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows, k // BLOCK, dtype=torch.uint8, device=x.device)
    if rows and k:
        scales = flat if row_scale is None else row_scale.reshape(-1).contiguous()
        quantize_activations_kernel[(-(-rows // BLOCK_ROWS), -(-k // BLOCK_K))](
            flat, scales, data, scale, rows, k, flat.stride(0), HAS_ROW_SCALE=row_scale is not None,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K, BLOCK=BLOCK, num_warps=4)
    return Quantized(data.view(torch.float8_e4m3fn).view(x.shape), scale.view(*x.shape[:-1], k // BLOCK), fmt, BLOCK)
