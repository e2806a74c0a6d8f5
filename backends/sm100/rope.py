"""sm100 ``apply_rope``: one Triton pass over the rows (:mod:`.fused.rope`)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.rope import check_rope_args
from deepinfer_backends.sm100.launch import on_device, require

MAX_WIDTH = 8192
ROW_ELEMENTS = 2048
"""A program turns at least this many elements (more short rows each) and at least ``BLOCK_ROWS`` rows."""


def apply_rope(x, positions, cos_sin, conjugate=False, out=None):
    """HAL ``apply_rope`` for CUDA ``x [T, ..., D]`` (bf16 or float32, ``D`` at most
    :data:`MAX_WIDTH`): ``x`` with its trailing ``cos_sin.shape[1]`` dims turned, in ``x.dtype``
    (contiguous, or written into ``out``). ``x`` and ``out`` are read and written in place when
    their rows are evenly spaced (a slice of the last axis of a contiguous tensor, say); otherwise
    ``x`` is copied first, and the result copied into ``out``. ``out`` may be ``x`` itself (each
    row is read whole before it is written)."""
    op = "apply_rope"
    require(on_device(x), op, "x must be a CUDA tensor")
    check_rope_args(x, positions, cos_sin, out)
    require(x.dtype in (torch.bfloat16, torch.float32), op, f"x must be bf16 or float32, got {x.dtype}")
    dim, rope = x.shape[-1], cos_sin.shape[1]
    require(dim <= MAX_WIDTH, op, f"the last axis ({dim}) must be at most {MAX_WIDTH} wide")
    import triton
    from deepinfer_backends.sm100.fused.rope import BLOCK_ROWS, HEAD_CHUNK, rope_kernel

    if _row_stride(x) is None:
        x = x.contiguous()
    target = out if out is not None and _row_stride(out) is not None else torch.empty(
        x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // dim if dim else 0
    if rows:
        table, half_block = cos_sin.float().contiguous(), triton.next_power_of_2(rope // 2)
        block_rows = max(BLOCK_ROWS, ROW_ELEMENTS // triton.next_power_of_2(dim))
        in_place = target.data_ptr() == x.data_ptr() and _row_stride(target) == _row_stride(x)
        rope_kernel[(-(-rows // block_rows),)](
            x, positions.contiguous(), table, target, rows, rows // x.shape[0], _row_stride(x),
            _row_stride(target), table.stride(0), -1.0 if conjugate else 1.0, HEAD=dim - rope, ROPE=rope,
            HALF_BLOCK=half_block, COPY_HEAD=dim > rope and not in_place, BLOCK_ROWS=block_rows,
            HEAD_CHUNK=HEAD_CHUNK, num_warps=4)
    return target if out is None or target is out else out.copy_(target)


def _row_stride(x: torch.Tensor) -> int | None:
    """Elements between consecutive rows of ``x [..., D]`` when every row is contiguous and the
    rows are evenly spaced (whatever the leading shape), else None."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return None
    axes = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size > 1]
    if any(outer[1] != inner[1] * inner[0] for outer, inner in zip(axes, axes[1:])):
        return None
    return axes[-1][1] if axes else x.shape[-1]
