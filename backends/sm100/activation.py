"""sm100 ``swiglu``: one Triton pass (:mod:`.fused.swiglu`)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.activation import check_swiglu_args
from deepinfer_backends.sm100.launch import on_device, require


def swiglu(gate, up, limit, dtype=None):
    """HAL ``swiglu`` for CUDA ``gate``, ``up`` (bf16 or float32, same shape)."""
    op = "swiglu"
    require(on_device(gate) and on_device(up), op, "gate and up must be CUDA tensors")
    check_swiglu_args(gate, up, limit)
    dtype = dtype or gate.dtype
    require({gate.dtype, up.dtype, dtype} <= {torch.bfloat16, torch.float32}, op,
            f"gate, up and the output must be bf16 or float32, got {gate.dtype}, {up.dtype} and {dtype}")
    from deepinfer_backends.sm100.fused.swiglu import BLOCK, swiglu_kernel

    out = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    count = out.numel()
    if count:
        swiglu_kernel[(-(-count // BLOCK),)](gate.contiguous(), up.contiguous(), out, count,
                                             float(limit or 0.0), CLAMP=limit is not None, BLOCK=BLOCK, num_warps=8)
    return out
