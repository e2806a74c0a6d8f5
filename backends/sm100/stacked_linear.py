"""sm100 ``stacked_linear``: the input's RMSNorm by ``rms_norm`` (when asked), then bf16 weights read
by a few rows in one Triton launch (:func:`.gemm.few_rows_linears`: each product its own contiguous
block of one buffer, RoPE or SwiGLU in its epilogue); otherwise one ``linear`` per weight with the
same kernel choice, ``apply_rope`` on the products that ``rope_heads`` names and ``swiglu``."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.grouped_gemm import check_out_dtype
from deepinfer.hal.ops.stacked_linear import check_stacked_linear, rope_products
from deepinfer_backends.sm100.activation import swiglu as swiglu_op
from deepinfer_backends.sm100.gemm import few_rows_linears, linear
from deepinfer_backends.sm100.norm import rms_norm
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions
from deepinfer_backends.sm100.rope import apply_rope


def stacked_linear(x, weights, positions=None, cos_sin=None, rope_heads=None, norm_weight=None,
                   norm_eps: float = 1e-6, keep_normed: bool = False, norm_dtype=None, swiglu: bool = False,
                   swiglu_limit: float | None = None, out_dtype=None, batch_invariant: bool = False,
                   options: KernelOptions = DEFAULT):
    """HAL ``stacked_linear``: :func:`~.norm.rms_norm` for ``norm_weight``, then
    :func:`~.gemm.few_rows_linears` where it serves (with the products' RoPE or SwiGLU), else
    :func:`~.gemm.linear` once per weight, :func:`~.rope.apply_rope` and :func:`~.activation.swiglu`."""
    check_stacked_linear(x, weights, positions, cos_sin, rope_heads, norm_weight, keep_normed, norm_dtype, swiglu)
    check_out_dtype("stacked_linear", out_dtype)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_eps).to(norm_dtype or x.dtype)
    rope = None if rope_heads is None else (positions, cos_sin, rope_heads)
    products = few_rows_linears(x, weights, batch_invariant, options, rope=rope,
                                swiglu=(swiglu_limit,) if swiglu else None, out_dtype=out_dtype)
    if products is not None:
        return products + (x,) if keep_normed else products
    products = few_rows_linears(x, weights, batch_invariant, options, out_dtype=out_dtype) if rope is not None else None
    if products is None:
        products = tuple(linear(x, w, out_dtype, batch_invariant=batch_invariant, options=options) for w in weights)
    products = rope_products(products, positions, cos_sin, rope_heads, rope=apply_rope)
    if swiglu:
        products = products[:-2] + (swiglu_op(products[-2], products[-1], swiglu_limit),)
    return products + (x,) if keep_normed else products
