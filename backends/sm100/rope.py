"""sm100 ``apply_rope``: one Triton pass over the rows (:mod:`.fused.rope`)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.rope import check_rope_args
from deepinfer_backends.sm100.launch import on_device, require

MAX_WIDTH = 8192


def apply_rope(x, positions, cos_sin, conjugate=False):
    """HAL ``apply_rope`` for CUDA ``x [T, ..., D]`` (bf16 or float32, ``D`` at most
    :data:`MAX_WIDTH`): ``x`` with its trailing ``cos_sin.shape[1]`` dims turned, in ``x.dtype``."""
    op = "apply_rope"
    require(on_device(x), op, "x must be a CUDA tensor")
    check_rope_args(x, positions, cos_sin)
    require(x.dtype in (torch.bfloat16, torch.float32), op, f"x must be bf16 or float32, got {x.dtype}")
    dim, rope = x.shape[-1], cos_sin.shape[1]
    require(dim <= MAX_WIDTH, op, f"the last axis ({dim}) must be at most {MAX_WIDTH} wide")
    import triton
    from deepinfer_backends.sm100.fused.rope import BLOCK_ROWS, rope_kernel

    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // dim if dim else 0
    if rows:
        table = cos_sin.float().contiguous()
        rope_kernel[(-(-rows // BLOCK_ROWS),)](
            x, positions.contiguous(), table, out, rows, rows // x.shape[0], dim, table.stride(0),
            -1.0 if conjugate else 1.0, ROPE=rope, BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(dim),
            num_warps=4)
    return out

