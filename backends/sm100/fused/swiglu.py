"""V4.1's clamped SwiGLU in one Triton pass: float32 math, one rounding to the output dtype."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def swiglu_kernel(gate, up, out, count, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """``out = silu(min(gate, limit)) * clamp(up, -limit, limit)`` over ``count`` elements
    (no clamping without ``CLAMP``)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < count
    g = tl.load(gate + i, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + i, mask=inside, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out + i, (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty), mask=inside)


def main() -> None:
    """Check the SwiGLU kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("swiglu")


if __name__ == "__main__":
    main()
