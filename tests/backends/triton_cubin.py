"""Compile one Triton kernel for Hopper (sm_90) to a cubin on a machine without a GPU: Triton's
front end, its GPU passes and the ptxas it ships."""
from __future__ import annotations


def hopper_cubin(kernel, signature: dict[str, str], constants: dict, **options) -> bytes:
    """The sm_90 cubin of the ``@triton.jit`` ``kernel`` with argument types ``signature``, the
    constexpr values ``constants`` and compile ``options`` (e.g. ``num_warps``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, signature={**signature, **{c: "constexpr" for c in constants}}, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
