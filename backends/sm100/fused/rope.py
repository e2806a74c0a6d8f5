"""Interleaved RoPE on the trailing dims of each row in one Triton kernel: the row is copied and
its rotated slice turned in the same pass, float32 math, stored in the input's dtype."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_ROWS = 4


@triton.jit
def rope_kernel(x, positions, cos_sin, out, rows, heads, dim, x_row_stride, out_row_stride, table_stride, sign,
                ROPE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``[BLOCK_ROWS * pid, BLOCK_ROWS * (pid + 1))`` of ``x [rows, dim]`` (``heads`` rows
    per token, ``x_row_stride`` elements apart): ``out`` (rows ``out_row_stride`` apart) ``= x`` with columns
    ``dim - ROPE ..`` turned in interleaved pairs by the token's angles (``cos_sin [P, ROPE]``:
    cos then sin; ``sign`` -1 turns backwards)."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = row < rows
    col = tl.arange(0, BLOCK_D)
    inside = live[:, None] & (col < dim)[None, :]
    start = row[:, None].to(tl.int64) * x_row_stride
    value = tl.load(x + start + col[None, :], mask=inside, other=0.0).to(tl.float32)
    local = col - (dim - ROPE)
    turning = inside & (local >= 0)[None, :]
    odd = (local & 1) == 1
    partner = tl.where(odd, col - 1, col + 1)
    other = tl.load(x + start + partner[None, :], mask=turning, other=0.0).to(tl.float32)
    position = tl.load(positions + row // heads, mask=live, other=0)
    angle = position[:, None] * table_stride + (local >> 1)[None, :]
    cos = tl.load(cos_sin + angle, mask=turning, other=1.0)
    sin = sign * tl.load(cos_sin + angle + ROPE // 2, mask=turning, other=0.0)
    turned = tl.where(odd[None, :], other * sin + value * cos, value * cos - other * sin)
    result = tl.where(turning, turned, value).to(out.dtype.element_ty)
    tl.store(out + row[:, None].to(tl.int64) * out_row_stride + col[None, :], result, mask=inside)


def main() -> None:
    """Check the RoPE kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("apply_rope")


if __name__ == "__main__":
    main()
