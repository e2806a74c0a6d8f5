"""Cache rows decoded to float32 or bf16 in one Triton kernel: bf16 rows, fp8 (e4m3 with a UE8M0
scale per 32 values), fp4 (packed e2m1, the even value in the low nibble, an e4m3 scale per 16)
and index_fp4 (packed e2m1, a UE8M0 scale per 32). Every product is exact in float32 and fits
bf16, so the values are the reference's bit for bit."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_backends.sm100.fused.mxfp4_cast import e2m1_value, power_of_two

BF16, FP8, FP4, INDEX_FP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
BLOCK_ROWS = 4


@triton.jit
def kv_load_kernel(rows, bf16_rows, fp8_rows, slots, out, n, ROW_BYTES: tl.constexpr, DIM: tl.constexpr,
                   KIND: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows ``[BLOCK_ROWS * pid, ...)`` of ``out [n, DIM]`` (float32 or bf16): the cache row at
    ``slots[i]`` (int64 or int32) decoded (zeros for slot -1). ``rows``: the cache as bytes ``[slots, ROW_BYTES]``;
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
        value = value * power_of_two(tl.load(rows + start + DIM + col // 32, mask=keep, other=127).to(tl.int32) - 127)
    else:
        packed = tl.load(rows + start + col // 2, mask=keep, other=0)
        value = e2m1_value((packed >> ((col & 1) * 4)) & 15)
        if KIND == FP4:
            value = value * tl.load(fp8_rows + start + DIM // 2 + col // 16, mask=keep, other=1.0).to(tl.float32)
        else:
            value = value * power_of_two(tl.load(rows + start + DIM // 2 + col // 32, mask=keep, other=127).to(tl.int32) - 127)
    tl.store(out + i.to(tl.int64)[:, None] * DIM + col, tl.where(keep, value, 0.0).to(out.dtype.element_ty),
             mask=live[:, None])


def main() -> None:
    """Check the cache-row decode kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("kv_load")


if __name__ == "__main__":
    main()
