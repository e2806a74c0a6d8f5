"""Interleaved RoPE on the trailing dims of each row in one Triton kernel: the rotated slice is
read as whole rows, split into its even and odd lanes in registers, turned in float32 and joined
back, so loads and stores stay contiguous; the columns before it are copied when the output is
another tensor."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_ROWS = 4
HEAD_CHUNK = 128
"""Columns before the rotated slice copied a step at a time."""


@triton.jit
def rope_kernel(x, positions, cos_sin, out, rows, heads, x_row_stride, out_row_stride, table_stride, sign,
                HEAD: tl.constexpr, ROPE: tl.constexpr, HALF_BLOCK: tl.constexpr, COPY_HEAD: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, HEAD_CHUNK: tl.constexpr):
    """Rows ``[BLOCK_ROWS * pid, BLOCK_ROWS * (pid + 1))`` of ``x [rows, HEAD + ROPE]`` (``heads``
    rows per token, ``x_row_stride`` elements apart): ``out`` (rows ``out_row_stride`` apart) gets
    columns ``HEAD ..`` turned in interleaved pairs by the token's angles (``cos_sin [P, ROPE]``: cos
    then sin; ``sign`` -1 turns backwards) and, with ``COPY_HEAD``, columns ``.. HEAD`` copied."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = row < rows
    x_row = x + row[:, None].to(tl.int64) * x_row_stride
    out_row = out + row[:, None].to(tl.int64) * out_row_stride
    if COPY_HEAD:
        for start in tl.static_range(0, HEAD, HEAD_CHUNK):
            col = start + tl.arange(0, HEAD_CHUNK)
            keep = live[:, None] & (col < HEAD)[None, :]
            tl.store(out_row + col[None, :], tl.load(x_row + col[None, :], mask=keep), mask=keep)
    col = HEAD + tl.arange(0, 2 * HALF_BLOCK)
    turning = live[:, None] & (col < HEAD + ROPE)[None, :]
    pairs = tl.load(x_row + col[None, :], mask=turning, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(pairs, (BLOCK_ROWS, HALF_BLOCK, 2)))
    half = tl.arange(0, HALF_BLOCK)
    angles = live[:, None] & (half < ROPE // 2)[None, :]
    position = tl.load(positions + row // heads, mask=live, other=0)
    angle = cos_sin + position[:, None].to(tl.int64) * table_stride + half[None, :]
    cos = tl.load(angle, mask=angles, other=1.0)
    sin = sign * tl.load(angle + ROPE // 2, mask=angles, other=0.0)
    turned = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_ROWS, 2 * HALF_BLOCK))
    tl.store(out_row + col[None, :], turned.to(out.dtype.element_ty), mask=turning)


def main() -> None:
    """Check the RoPE kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("apply_rope")


if __name__ == "__main__":
    main()
