"""Cache rows decoded to float32 in one Triton kernel: bf16 rows, fp8 (e4m3 with a UE8M0 scale
per 32 values), fp4 (packed e2m1, the even value in the low nibble, an e4m3 scale per 16) and
index_fp4 (packed e2m1, a UE8M0 scale per 32). Every product is exact in float32, so the
values are the reference's bit for bit."""
from __future__ import annotations

import triton
import triton.language as tl

BF16, FP8, FP4, INDEX_FP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
BLOCK_ROWS = 4


@triton.jit
def _ue8m0(byte):
    """2 ** (byte - 127) as float32, built from its bits (byte 0: 2 ** -127, a subnormal)."""
    bits = byte.to(tl.int32) << 23
    return tl.where(byte == 0, 5.877471754111438e-39, bits.to(tl.float32, bitcast=True))


@triton.jit
def _e2m1(code):
    """float32 value of 4-bit e2m1 codes (sign in bit 3)."""
    magnitude = code & 7
    exponent = magnitude >> 1
    half = (magnitude & 1).to(tl.float32) * 0.5
    value = tl.where(exponent == 0, half, tl.where(exponent == 1, 1.0, tl.where(exponent == 2, 2.0, 4.0)) * (1 + half))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def kv_load_kernel(rows, bf16_rows, fp8_rows, slots, out, n, ROW_BYTES: tl.constexpr, DIM: tl.constexpr,
                   KIND: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows ``[BLOCK_ROWS * pid, ...)`` of ``out [n, DIM]``: the cache row at ``slots[i]``
    decoded (zeros for slot -1). ``rows``: the cache as bytes ``[slots, ROW_BYTES]``;
    ``bf16_rows`` and ``fp8_rows``: the same bytes viewed as bf16 and e4m3."""
    i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = i < n
    slot = tl.load(slots + i, mask=live, other=-1)
    keep = (live & (slot >= 0))[:, None]
    col = tl.arange(0, DIM)[None, :]
    start = slot.to(tl.int64)[:, None] * ROW_BYTES
    if KIND == BF16:
        value = tl.load(bf16_rows + start // 2 + col, mask=keep, other=0.0).to(tl.float32)
    elif KIND == FP8:
        value = tl.load(fp8_rows + start + col, mask=keep, other=0.0).to(tl.float32)
        value = value * _ue8m0(tl.load(rows + start + DIM + col // 32, mask=keep, other=127))
    else:
        packed = tl.load(rows + start + col // 2, mask=keep, other=0)
        value = _e2m1((packed >> ((col & 1) * 4)) & 15)
        if KIND == FP4:
            value = value * tl.load(fp8_rows + start + DIM // 2 + col // 16, mask=keep, other=1.0).to(tl.float32)
        else:
            value = value * _ue8m0(tl.load(rows + start + DIM // 2 + col // 32, mask=keep, other=127))
    tl.store(out + i.to(tl.int64)[:, None] * DIM + col, tl.where(keep, value, 0.0), mask=live[:, None])
