"""V4.1's clamped SwiGLU in one Triton pass: float32 math, one rounding to the output dtype."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def clamped_swiglu(gate, up, limit, CLAMP: tl.constexpr):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` of float32 values (no clamping
    without ``CLAMP``), shared by the kernels that store a SwiGLU."""
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def swiglu_kernel(gate, up, out, count, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """``out = silu(min(gate, limit)) * clamp(up, -limit, limit)`` over ``count`` elements
    (no clamping without ``CLAMP``)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < count
    g = tl.load(gate + i, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + i, clamped_swiglu(g, u, limit, CLAMP).to(out.dtype.element_ty), mask=inside)


def main() -> None:
    """Check the SwiGLU kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("swiglu")


if __name__ == "__main__":
    main()
