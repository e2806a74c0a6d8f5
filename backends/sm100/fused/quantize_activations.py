"""Activations cast to e4m3 with one UE8M0 scale per 32 values in one Triton pass (the HAL
``quantize_activations``): bf16 or float32 rows in, e4m3 codes and scale bytes out.

A block's magnitude max, raised to the floor, gives the scale byte from its float32 bits: with
``max = m * 2^E`` (``m`` in [1, 2)) the least power of two at or above ``max / 448`` is
``2^(E - 8)`` for ``m <= 1.75`` (448 is ``1.75 * 2^8``) and ``2^(E - 7)`` above, and adding
``0x1FFFFF`` to the bits carries into the exponent exactly when the mantissa field is above
``0x600000``. That is the reference's rule (a float32 division, then the power of two read from
the quotient's bits) for every max at or above the floor, with no division. The values are
multiplied by the scale's reciprocal (exact) and rounded to e4m3's precision in float32, nearest
with ties to even: three mantissa bits by integer rounding of the bits from ``2 ** -6`` up, the
subnormal step ``2 ** -9`` below by adding and subtracting ``1.5 * 2 ** 14``. The conversion to
e4m3 is then exact, so the codes are the reference's whatever rounding it uses (Triton's
interpreter truncates); the sign bit is kept for a value that rounds to zero."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.hal.formats import FP8_AMAX_FLOOR

BLOCK = 32
"""Values under one scale byte."""
BLOCK_ROWS = 8
BLOCK_K = 512
"""Rows and columns one program casts (``K`` need not be a multiple)."""
AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0 ** 14)
"""A float32 whose spacing is e4m3's subnormal step ``2 ** -9``."""


@triton.jit
def quantize_activations_kernel(x, row_scale, data, scale, rows, k, x_stride, HAS_ROW_SCALE: tl.constexpr,
                                BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``[BLOCK_ROWS p, +BLOCK_ROWS)`` and columns ``[BLOCK_K q, +BLOCK_K)`` of ``x [rows, k]``
    (row stride ``x_stride``; with ``HAS_ROW_SCALE`` times float32 ``row_scale [rows]``, in
    float32) into ``data uint8 [rows, k]`` (e4m3 codes) and ``scale uint8 [rows, k / BLOCK]``;
    ``k`` a multiple of ``BLOCK``."""
    GROUPS: tl.constexpr = BLOCK_K // BLOCK
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (row < rows)[:, None] & (column < k)[None, :]
    value = tl.load(x + row[:, None] * x_stride + column[None, :], mask=inside, other=0.0).to(tl.float32)
    if HAS_ROW_SCALE:
        value = value * tl.load(row_scale + row, mask=row < rows, other=0.0)[:, None]
    blocks = tl.reshape(value, (BLOCK_ROWS, GROUPS, BLOCK))
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=2), AMAX_FLOOR)
    byte = ((amax.to(tl.int32, bitcast=True) + 0x1FFFFF) >> 23) - 8
    reciprocal = ((254 - byte) << 23).to(tl.float32, bitcast=True)
    scaled = tl.reshape(blocks * reciprocal[:, :, None], (BLOCK_ROWS, BLOCK_K))
    bits = scaled.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = (tl.abs(scaled) + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER
    rounded = tl.where(magnitude < 0x3C800000, tiny, normal)  # 0x3C800000: 2 ** -6
    code = rounded.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | ((bits >> 24) & 0x80).to(tl.uint8)
    tl.store(data + row[:, None] * k + column[None, :], code, mask=inside)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    tl.store(scale + row[:, None] * (k // BLOCK) + group[None, :], byte.to(tl.uint8),
             mask=(row < rows)[:, None] & (group < k // BLOCK)[None, :])


def main() -> None:
    """Check the cast against the OpSpec reference on this GPU, bit for bit
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("quantize_activations")


if __name__ == "__main__":
    main()
