"""FP8 rows with UE8M0 scales per 32 along K moved to one scale per 128, in one Triton pass, for
the native FP8 grouped GEMM (``kernels/grouped_gemm_fp8_k128.py``).

Per row and 128 values the largest scale byte ``E`` is kept, and each block of 32 with byte ``s``
has its e4m3 values multiplied by ``2 ** (s - E)``: the exponent field drops by ``E - s`` while it
stays at least 1, else the value becomes an e4m3 subnormal, its significand shifted right with
round-to-nearest-even. Integer operations only, so the bytes are those of
:func:`~deepinfer_backends.sm100.fp8_scales.align_reference`
(multiply, then round to e4m3) on any device. A block with scale byte 0 reads as zeros; NaN codes
are not expected (the quantizer never writes them)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
ROWS = 8
"""Rows a program aligns."""


@triton.jit
def align_fp8_kernel(x, x_scale, out, out_scale, m, k, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """``out uint8 [m, k]`` (e4m3 codes) and ``out_scale float32 [m, k / GROUP]`` (``2 ** (E -
    127)``) of ``x uint8 [m, k]`` (e4m3 codes) with ``x_scale uint8 [m, k / 32]``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    live = rows[:, None] < m
    code = tl.load(x + rows[:, None] * k + cols[None, :], mask=live, other=0).to(tl.int32)
    byte = tl.load(x_scale + rows[:, None] * (k // 32) + cols[None, :] // 32, mask=live, other=0).to(tl.int32)
    top = tl.max(byte, axis=1)
    drop = top[:, None] - byte
    exponent = (code >> 3) & 15
    mantissa = code & 7
    stays_normal = exponent > drop
    normal = ((exponent - drop) << 3) | mantissa
    significand = tl.where(exponent > 0, mantissa | 8, mantissa)
    shift = tl.minimum(drop - tl.maximum(exponent, 1) + 1, 8)
    shift = tl.maximum(shift, 0)
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = (1 << shift) >> 1
    round_up = (rest > half) | ((rest == half) & (half > 0) & ((kept & 1) == 1))
    subnormal = kept + round_up.to(tl.int32)
    value = tl.where(stays_normal, normal, subnormal) | (code & 128)
    value = tl.where(byte == 0, 0, value)
    tl.store(out + rows[:, None] * k + cols[None, :], value.to(tl.uint8), mask=live)
    bits = tl.where(top > 0, top << 23, 1 << 22)
    tl.store(out_scale + rows * (k // GROUP) + group, bits.to(tl.float32, bitcast=True), mask=rows < m)


def align_fp8(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [m, k], float32 [m, k / 128])`` of FP8 rows ``data e4m3 [m, k]`` with ``scale uint8
    [m, k / 32]``; ``k`` a multiple of 128."""
    m, k = data.shape
    if k % GROUP or tuple(scale.shape) != (m, k // 32) or scale.dtype != torch.uint8:
        raise ValueError(f"align_fp8 takes data [m, k] with k a multiple of {GROUP} and uint8 scale [m, k/32]; "
                         f"got data {tuple(data.shape)}, scale {scale.dtype} {tuple(scale.shape)}")
    out = torch.empty(m, k, dtype=torch.uint8, device=data.device)
    out_scale = torch.empty(m, k // GROUP, dtype=torch.float32, device=data.device)
    if m:
        align_fp8_kernel[(triton.cdiv(m, ROWS), k // GROUP)](
            data.contiguous().view(torch.uint8), scale.contiguous(), out, out_scale, m, k, ROWS=ROWS, GROUP=GROUP)
    return out.view(torch.float8_e4m3fn), out_scale


def main() -> None:
    """Check the bytes against :func:`~deepinfer_backends.sm100.fp8_scales.aligned`
    on this GPU: every non-NaN e4m3 code under random scale bytes (some 0), ragged row counts."""
    from deepinfer.hal.formats import Quantized
    from deepinfer_backends.sm100.fp8_scales import aligned

    gen = torch.Generator().manual_seed(0)
    for m, k in ((1, 128), (37, 512), (1000, 4096)):
        codes = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
        scale = torch.randint(100, 140, (m, k // 32), generator=gen, dtype=torch.uint8)
        scale[torch.rand(m, k // 32, generator=gen) < 0.05] = 0
        q = Quantized(codes.view(torch.float8_e4m3fn).cuda(), scale.cuda(), "fp8", 32)
        want, want_scale = aligned(q)
        got, got_scale = align_fp8(q.data, q.scale)
        same = torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)
        print(f"align_fp8 m={m} k={k}: {'PASS' if same else 'FAIL'}")


if __name__ == "__main__":
    main()
