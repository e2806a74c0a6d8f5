"""sm100 ``stacked_linear``: bf16 weights read by a few rows in one Triton launch
(:func:`.gemm.few_rows_linears`: each product its own contiguous block of one buffer); otherwise one
``linear`` per weight, with the same kernel choice."""
from __future__ import annotations

from deepinfer.hal.ops.stacked_linear import check_stacked_linear
from deepinfer_backends.sm100.gemm import few_rows_linears, linear
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions


def stacked_linear(x, weights, batch_invariant: bool = False, options: KernelOptions = DEFAULT):
    """HAL ``stacked_linear``: :func:`~.gemm.few_rows_linears` where it serves, else
    :func:`~.gemm.linear` once per weight."""
    check_stacked_linear(x, weights)
    products = few_rows_linears(x, weights, batch_invariant, options)
    if products is not None:
        return products
    return tuple(linear(x, w, batch_invariant=batch_invariant, options=options) for w in weights)
