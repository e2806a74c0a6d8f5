"""The mHC stream reads and writes of a sublayer in one Triton kernel each (and the write of one
sublayer with the read of the next in one), float32 math in the reference's order, one program
per (token, ``BLOCK_HIDDEN`` columns); one program per token where the next input is RMS-normalised
(the whole row in one program)."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_HIDDEN = 1024


@triton.jit
def mhc_pre_kernel(residual, pre, out, hidden, HC: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t, h] = sum_m pre[t, m] * residual[t, m, h]`` (``residual`` contiguous ``[T, HC,
    hidden]``, ``pre`` float32 ``[T, HC]``), stored in ``out``'s dtype."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = h < hidden
    total = tl.zeros((BLOCK,), tl.float32)
    for m in tl.static_range(HC):
        stream = tl.load(residual + (t * HC + m) * hidden + h, mask=inside, other=0.0).to(tl.float32)
        total += tl.load(pre + t * HC + m) * stream
    tl.store(out + t * hidden + h, total.to(out.dtype.element_ty), mask=inside)


@triton.jit
def mhc_post_kernel(y, residual, post, comb, pre, out, x, norm_weight, hidden, norm_eps, HC: tl.constexpr,
                    BLOCK: tl.constexpr, READ_NEXT: tl.constexpr, NORM: tl.constexpr):
    """``out[t, n, h] = post[t, n] * y[t, h] + sum_m comb[t, m, n] * residual[t, m, h]`` (all
    contiguous; ``post``, ``comb`` float32), stored in ``out``'s dtype. With ``READ_NEXT`` also
    ``x[t, h] = sum_n pre[t, n] * out[t, n, h]`` of the stored (rounded) ``out`` values, the
    streams added in order as :func:`mhc_pre_kernel` does, stored in ``x``'s dtype; with ``NORM``
    (``BLOCK`` covering the row) that input rounded to ``x``'s dtype, then RMS-normalised with the
    float32 ``norm_weight`` as the HAL ``rms_norm`` does."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = h < hidden
    written = tl.load(y + t * hidden + h, mask=inside, other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    for n in tl.static_range(HC):
        carried = tl.zeros((BLOCK,), tl.float32)
        for m in tl.static_range(HC):  # the streams come from DRAM for n = 0, from L1 after
            stream = tl.load(residual + (t * HC + m) * hidden + h, mask=inside, other=0.0).to(tl.float32)
            carried += tl.load(comb + (t * HC + m) * HC + n) * stream
        stored = (tl.load(post + t * HC + n) * written + carried).to(out.dtype.element_ty)
        tl.store(out + (t * HC + n) * hidden + h, stored, mask=inside)
        if READ_NEXT:
            total += tl.load(pre + t * HC + n) * stored.to(tl.float32)
    if NORM:
        total = tl.where(inside, total.to(x.dtype.element_ty).to(tl.float32), 0.0)
        inv_rms = 1.0 / tl.sqrt(tl.sum(total * total, axis=0) / hidden + norm_eps)
        total = total * inv_rms * tl.load(norm_weight + h, mask=inside, other=0.0)
    if READ_NEXT:
        tl.store(x + t * hidden + h, total.to(x.dtype.element_ty), mask=inside)


def main() -> None:
    """Check the mHC stream kernels against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("mhc_pre", "mhc_post", "mhc_post_pre")


if __name__ == "__main__":
    main()
