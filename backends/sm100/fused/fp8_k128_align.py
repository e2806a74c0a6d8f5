"""Activation rows moved to one scale per 128 along K in one Triton kernel, for the native FP8
grouped GEMM (:mod:`deepinfer_backends.sm100.fp8_k128`).

Per row and group of 128 values (four blocks of 32) it takes each block's exponent, either from
the operand's UE8M0 bytes (e4m3 rows; byte 0 reads as a zero block) or from a cast of bf16 rows
done here as :func:`deepinfer.hal.formats.quantize` casts to ``fp8`` (the block max floored at
:data:`~deepinfer.hal.formats.FP8_AMAX_FLOOR`, the least power of two at or above ``max / 448``,
the values times its reciprocal rounded to e4m3). Each block is multiplied by
``2 ** (its exponent - the group's largest)`` and rounded to e4m3 (nearest, ties to even), and
the group's scale ``2 ** largest`` is stored as float32: the operands of
:func:`~deepinfer_backends.sm100.kernels.grouped_gemm_fp8_k128.align_reference`, bit for bit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.hal.formats import E4M3_MAX, FP8_AMAX_FLOOR
from deepinfer_backends.sm100.fused.mxfp4_cast import _ceil_log2, power_of_two

ROWS = 8
"""Rows a program aligns (one group of 128 each)."""
AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
FMT_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def to_e4m3(y):
    """float32 ``y`` (within +-448) rounded to e4m3, nearest with ties to even, subnormals
    included: the value is first rounded onto its binade's grid of 3 mantissa bits (2^-9 below
    e4m3's normal range) by float32 arithmetic, so the conversion itself is exact whatever
    rounding the conversion applies (Triton's interpreter does not round to nearest even); a
    value rounding to zero keeps its sign."""
    magnitude = tl.abs(y)
    binade = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
    shifter = power_of_two(binade + 20) * 1.5  # 1.5 * 2^23 grid steps: the sum rounds, ties to even
    rounded = (magnitude + shifter) - shifter
    return tl.where(y < 0, -rounded, rounded).to(tl.float8e4nv)


@triton.jit
def align_rows_kernel(x, scale, out, out_scale, rows, K: tl.constexpr, QUANTIZE: tl.constexpr,
                      ROWS: tl.constexpr):
    """Rows ``ROWS * pid(0) ..`` of group ``pid(1)``: ``x`` e4m3 with UE8M0 ``scale [rows, K/32]``,
    or bf16 (``QUANTIZE``; ``scale`` unread) into e4m3 ``out`` and float32 ``out_scale [K/128, rows]``."""
    group = tl.program_id(1)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    block = tl.arange(0, 4)
    col = group * 128 + block[:, None] * 32 + tl.arange(0, 32)[None, :]
    live = row < rows
    offsets = row[:, None, None].to(tl.int64) * K + col[None, :, :]
    values = tl.load(x + offsets, mask=live[:, None, None], other=0.0).to(tl.float32)
    if QUANTIZE:
        amax = tl.maximum(tl.max(tl.abs(values), axis=2), AMAX_FLOOR)
        exponent = _ceil_log2(tl.math.div_rn(amax, tl.full(amax.shape, FMT_MAX, tl.float32)))
        scaled = values * power_of_two(-exponent)[:, :, None]
        values = to_e4m3(tl.clamp(scaled, -FMT_MAX, FMT_MAX)).to(tl.float32)
    else:
        byte = tl.load(scale + row[:, None].to(tl.int64) * (K // 32) + group * 4 + block[None, :],
                       mask=live[:, None], other=127).to(tl.int32)
        exponent = byte - 127
        values = tl.where((byte == 0)[:, :, None], 0.0, values)
    top = tl.max(exponent, axis=1)
    shift = power_of_two(tl.maximum(exponent - top[:, None], -127))
    tl.store(out + offsets, to_e4m3(values * shift[:, :, None]), mask=live[:, None, None])
    tl.store(out_scale + group * rows + row, power_of_two(top), mask=live)


def align_rows(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [rows, k], float32 [k/128, rows])`` of ``x``: e4m3 with UE8M0 ``scale [rows, k/32]``,
    or bf16 (``scale`` None: cast to FP8 per 32 first); ``k`` a multiple of 128. The scales are
    K-group-major, as the kernel reads them."""
    rows, k = x.shape
    if k % 128:
        raise ValueError(f"align_rows needs k a multiple of 128, got {k}")
    out = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    out_scale = torch.empty(k // 128, rows, dtype=torch.float32, device=x.device)
    if rows:
        quantize = scale is None
        align_rows_kernel[(triton.cdiv(rows, ROWS), k // 128)](
            x.contiguous(), x if quantize else scale.contiguous(), out, out_scale, rows, K=k, QUANTIZE=quantize,
            ROWS=ROWS)
    return out, out_scale


def main() -> None:
    """Check both inputs against the torch model on the current GPU, bit for bit, and time them."""
    from triton.testing import do_bench

    from deepinfer.hal.formats import quantize
    from deepinfer_backends.sm100.fp8_k128 import aligned

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 4096, device="cuda", generator=g)
    x = x * torch.exp2(torch.randint(-6, 7, (16384, 128), device="cuda", generator=g).float()).repeat_interleave(32, -1)
    q = quantize(x, "fp8")
    for label, args, model in (("fp8 rows", (q.data, q.scale), q), ("bf16 rows", (x.bfloat16(), None),
                                                                     quantize(x.bfloat16(), "fp8"))):
        data, scale = align_rows(*args)
        want_data, want_scale = aligned(model)
        same = torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(scale, want_scale.T)
        ms = do_bench(lambda: align_rows(*args))
        moved = args[0].nbytes + data.nbytes + scale.nbytes + (args[1].nbytes if args[1] is not None else 0)
        print(f"align_rows {label} {tuple(x.shape)}: {'PASS' if same else 'FAIL'} {ms * 1e3:.1f} us "
              f"{moved / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
