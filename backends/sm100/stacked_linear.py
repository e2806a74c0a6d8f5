"""sm100 ``stacked_linear``: bf16 weights read by a few rows in one Triton launch
(:func:`.linear.few_rows_linears`: each product its own contiguous block of one buffer, RoPE or
SwiGLU in its epilogue, the input's RMSNorm in the kernel for short rows, else by ``rms_norm``
ahead of it); otherwise one ``linear`` per weight with the same kernel choice, ``apply_rope`` on
the products that ``rope_heads`` names and ``swiglu``."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.grouped_gemm import check_out_dtype
from deepinfer.hal.ops.stacked_linear import check_stacked_linear, rope_products
from deepinfer_backends.sm100.activation import swiglu as swiglu_op
from deepinfer_backends.sm100.linear import few_rows_linears, linear
from deepinfer_backends.sm100.norm import rms_norm
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions
from deepinfer_backends.sm100.rope import apply_rope


def stacked_linear(x, weights, positions=None, cos_sin=None, rope_heads=None, norm_weight=None,
                   norm_eps: float = 1e-6, keep_normed: bool = False, norm_dtype=None, swiglu: bool = False,
                   swiglu_limit: float | None = None, out_dtype=None, mxfp4_products=(), batch_invariant: bool = False,
                   options: KernelOptions = DEFAULT):
    """HAL ``stacked_linear``: :func:`~.linear.few_rows_linears` where it serves (with the products'
    RoPE or SwiGLU, and the input's RMSNorm for rows of at most
    :data:`~.fused.linear_skinny.NORM_MAX_K`, and the MXFP4 casts), else :func:`~.norm.rms_norm`
    for ``norm_weight`` and :func:`~.linear.linear` once per weight, :func:`~.rope.apply_rope`,
    :func:`~.activation.swiglu` and :func:`mxfp4_cast`."""
    check_stacked_linear(x, weights, positions, cos_sin, rope_heads, norm_weight, keep_normed, norm_dtype, swiglu,
                         mxfp4_products)
    check_out_dtype("stacked_linear", out_dtype)
    rope = None if rope_heads is None else (positions, cos_sin, rope_heads)
    fused = dict(rope=rope, swiglu=(swiglu_limit,) if swiglu else None, out_dtype=out_dtype, mxfp4=mxfp4_products)
    if norm_weight is not None and not keep_normed and (norm_dtype or x.dtype) == torch.bfloat16:
        products = few_rows_linears(x, weights, batch_invariant, options, norm=(norm_weight, norm_eps), **fused)
        if products is not None:
            return products
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_eps).to(norm_dtype or x.dtype)
    products = few_rows_linears(x, weights, batch_invariant, options, **fused)
    if products is not None:
        return products + (x,) if keep_normed else products
    products = few_rows_linears(x, weights, batch_invariant, options, out_dtype=out_dtype) if rope is not None else None
    if products is None:
        products = tuple(linear(x, w, out_dtype, batch_invariant=batch_invariant, options=options) for w in weights)
    products = rope_products(products, positions, cos_sin, rope_heads, rope=apply_rope)
    if swiglu:
        products = products[:-2] + (swiglu_op(products[-2], products[-1], swiglu_limit),)
    products = tuple(mxfp4_cast(y) if i in mxfp4_products else y for i, y in enumerate(products))
    return products + (x,) if keep_normed else products


def mxfp4_cast(y: torch.Tensor) -> torch.Tensor:
    """``y [..., N]`` (``N`` a multiple of 32) cast through MXFP4 and back in blocks of 32 along
    ``N``, in ``y.dtype``: one launch of :func:`~.fused.mxfp4_cast.mxfp4_cast_kernel` for bf16
    (each block of 128 or 32 values one kernel row), the reference's ``cast_back`` otherwise."""
    if y.dtype != torch.bfloat16:
        from deepinfer.hal.formats import cast_back

        return cast_back(y, "mxfp4", 32).to(y.dtype)
    from deepinfer_backends.sm100.fused.mxfp4_cast import BLOCK_ROWS, mxfp4_cast_kernel

    dim = 128 if y.shape[-1] % 128 == 0 else 32
    flat = y.contiguous().view(-1, dim)
    out = torch.empty_like(flat)
    if flat.shape[0]:
        mxfp4_cast_kernel[(-(-flat.shape[0] // BLOCK_ROWS),)](flat, out, flat.shape[0], 1, 1, dim, DIM=dim,
                                                             BLOCK_ROWS=BLOCK_ROWS)
    return out.view(y.shape)
