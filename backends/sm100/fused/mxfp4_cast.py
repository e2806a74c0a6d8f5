"""Rows cast through MXFP4 and back in one Triton kernel: per 32 values a UE8M0 scale (the
least power of two at or above ``max / 6``, ``max`` the block's largest magnitude floored at
``6 * 2**-126``), each value rounded to e2m1 (to nearest, ties to the even code, its sign bit
kept so a negative value rounding to zero gives ``-0``) and scaled back, stored as bf16 (exact).
Exponents come from the float's bits and every scaling is a product by a power of two, so the
values are the reference's (:func:`deepinfer.hal.formats.cast_back`) bit for bit, except where
a decoded value is below ``2**-126`` (a code of 0.5 under the smallest scale), which may be
flushed to zero."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.hal.formats import MXFP4_AMAX_FLOOR

BLOCK_ROWS = 4
AMAX_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
"""The least block max a scale is taken from."""


@triton.jit
def _ceil_log2(ratio):
    """``ceil(log2(ratio))`` of positive normal float32 ``ratio``, exact, from its bits."""
    bits = ratio.to(tl.int32, bitcast=True)
    return ((bits - 1) >> 23) + 1 - 127


@triton.jit
def power_of_two(exponent):
    """``2 ** exponent`` as float32 for integer ``exponent`` in ``[-127, 127]``, from its bits
    (-127: the subnormal ``2 ** -127``); a UE8M0 byte ``b`` is ``power_of_two(b - 127)``."""
    normal = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(exponent == -127, 5.877471754111438e-39, normal)


@triton.jit
def e2m1_value(code):
    """float32 value of 4-bit e2m1 codes (sign in bit 3)."""
    magnitude = code & 7
    exponent = magnitude >> 1
    half = (magnitude & 1).to(tl.float32) * 0.5
    value = tl.where(exponent == 0, half, tl.where(exponent == 1, 1.0, tl.where(exponent == 2, 2.0, 4.0)) * (1 + half))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def cast_blocks(blocks):
    """float32 ``blocks [..., 32]`` cast through MXFP4 and back (one scale per block), float32."""
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=len(blocks.shape) - 1), AMAX_FLOOR)
    exponent = _ceil_log2(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
    scaled = blocks * tl.expand_dims(power_of_two(-exponent), -1)
    a = tl.abs(scaled)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0))
    sign = (scaled.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3
    return e2m1_value(code | sign) * tl.expand_dims(power_of_two(exponent), -1)


@triton.jit
def mxfp4_cast_kernel(x, out, rows, heads, out_heads, out_dim, DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows ``[BLOCK_ROWS * pid, ...)`` of ``x [rows, DIM]`` (``heads`` rows per token) cast, into
    ``out [tokens, out_heads, out_dim]`` bf16 at the row's token and head."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = row < rows
    col = tl.arange(0, DIM)
    value = tl.load(x + row[:, None].to(tl.int64) * DIM + col[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    signed = cast_blocks(tl.reshape(value, (BLOCK_ROWS, DIM // 32, 32)))
    target = (row // heads).to(tl.int64) * out_heads + row % heads
    tl.store(out + target[:, None] * out_dim + col[None, :], tl.reshape(signed, (BLOCK_ROWS, DIM)).to(tl.bfloat16),
             mask=live[:, None])


def main() -> None:
    """Check the MXFP4 query cast, through the indexer logits that use it against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("indexer_logits")


if __name__ == "__main__":
    main()
