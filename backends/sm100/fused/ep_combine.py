"""Expert outputs summed back into their tokens in one Triton kernel (one rank): each token adds
its routed slots' rows, weighted or as they are, in slot order, float32, from zero (and then,
when given, the shared expert's row)."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_HIDDEN = 1024


@triton.jit
def ep_combine_kernel(y, row_of_pair, weights, routed, add, out, hidden, TOP_K: tl.constexpr,
                      HAS_ROUTED: tl.constexpr, HAS_ADD: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t, h] = sum_j weights[r] * y[r, h]`` (``y[r, h]`` unless ``WEIGHTED``) over slots ``j``
    of token ``t = pid0``, ``r = row_of_pair[t * TOP_K + j]`` (pairs with ``routed[r]`` false
    skipped when ``HAS_ROUTED``); with ``HAS_ADD`` the sum rounded to ``y``'s dtype, then
    ``add``'s, plus ``add[t, h]``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = h < hidden
    total = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.load(row_of_pair + t * TOP_K + j)
        take = inside
        if HAS_ROUTED:
            take = h < tl.where(tl.load(routed + r) != 0, hidden, 0)
        row = tl.load(y + r * hidden + h, mask=take, other=0.0).to(tl.float32)
        if WEIGHTED:
            row = tl.load(weights + r) * row
        total += tl.where(take, row, 0.0)
    if HAS_ADD:
        rounded = total.to(y.dtype.element_ty).to(add.dtype.element_ty).to(tl.float32)
        total = rounded + tl.load(add + t * hidden + h, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + t * hidden + h, total.to(out.dtype.element_ty), mask=inside)


def main() -> None:
    """Check the expert combine kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("ep_combine")


if __name__ == "__main__":
    main()
