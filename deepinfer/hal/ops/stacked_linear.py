"""Several linears of one input, ``tuple(linear(x, w) for w in weights)``: the projections a layer
takes from the same hidden state (DeepInfer fuses them in one GEMM: the query's ``q_a`` with the
SWA key's ``wkv``, the compressor with the indexer's head weights, ``q_b`` with the indexer's
queries, the shared expert's gate and up).

One op, so a backend can read the input once and stream every weight in one launch; each product
is its own tensor, as :func:`~deepinfer.hal.ops.grouped_gemm.linear` would return it. A product
may leave with RoPE applied to each of its heads (``rope_heads``): DeepInfer turns the query's
rotary dims in its projection's epilogue, and a backend may do the same."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.hal.ops.grouped_gemm import (ACTIVATION_FORMATS, WEIGHT_FORMATS, Operand, _operand, check_out_dtype,
                                            linear, logical_shape)
from deepinfer.hal.formats import cast_back
from deepinfer.hal.ops import activation
from deepinfer.hal.ops.norm import rms_norm
from deepinfer.hal.ops.rope import apply_rope, check_rope_args, rope_cos_sin, rope_inv_freq
from deepinfer.hal.spec import FLOAT32_OUTPUT, OpCase, OpSpec, register


def stacked_linear(x: Operand, weights: Sequence[Operand], positions: torch.Tensor | None = None,
                   cos_sin: torch.Tensor | None = None, rope_heads: Sequence[int] | None = None,
                   norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                   keep_normed: bool = False, norm_dtype: torch.dtype | None = None, swiglu: bool = False,
                   swiglu_limit: float | None = None, out_dtype: torch.dtype | None = None,
                   mxfp4_products: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x, w, out_dtype) for w in weights)``: ``x [..., K]``, each ``weight [N_i, K]``
    plain or :class:`~deepinfer.hal.formats.Quantized` as :func:`linear` takes it; each product
    ``[..., N_i]`` in :func:`linear`'s dtype (``out_dtype``; else ``x.dtype`` for plain operands,
    float32 if quantized).

    With ``rope_heads`` (one head width per weight, 0 for a product left as it is), ``positions``
    (int64 ``[T]``) and ``cos_sin`` (``[P, R]``) as :func:`~deepinfer.hal.ops.rope.apply_rope`
    takes them, for ``x [T, K]``: product ``i``, seen as ``[T, N_i / rope_heads[i], rope_heads[i]]``,
    leaves with the trailing ``R`` dims of every head turned by ``apply_rope`` at the token's
    position (from the product rounded to its dtype, as the two ops in a row would).

    With ``norm_weight`` (``[K]``) the weights read ``rms_norm(x, norm_weight, norm_eps)`` (in
    ``x.dtype``, as :func:`~deepinfer.hal.ops.norm.rms_norm` returns it, then rounded to
    ``norm_dtype`` when given) instead of ``x``: the normalisation ahead of a layer's projections,
    which a backend may fold into their prologue.
    ``keep_normed`` appends that normalised input to the products (for the MoE's dispatch, which
    reads it too).

    With ``swiglu`` the last two weights are a gate and an up projection of one width: their two
    products are replaced by one, :func:`~deepinfer.hal.ops.activation.swiglu` of them with
    ``swiglu_limit`` (the shared expert's activation, which a backend may compute in the
    products' epilogue).

    The products ``mxfp4_products`` names (indices, each width a multiple of 32) leave cast
    through MXFP4 and back (:func:`~deepinfer.hal.formats.cast_back` with blocks of 32 along the
    width, after the RoPE, in the product's dtype): the indexer's queries, which its scores read
    in that format (a backend may cast them in the products' epilogue)."""
    check_stacked_linear(x, weights, positions, cos_sin, rope_heads, norm_weight, keep_normed, norm_dtype, swiglu,
                         mxfp4_products)
    check_out_dtype("stacked_linear", out_dtype)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_eps).to(norm_dtype or x.dtype)
    products = rope_products(tuple(linear(x, w, out_dtype) for w in weights), positions, cos_sin, rope_heads)
    if swiglu:
        products = products[:-2] + (activation.swiglu(products[-2], products[-1], swiglu_limit),)
    products = tuple(cast_back(y, "mxfp4", 32).to(y.dtype) if i in mxfp4_products else y
                     for i, y in enumerate(products))
    return products + (x,) if keep_normed else products


def rope_products(products, positions, cos_sin, rope_heads, rope=apply_rope) -> tuple[torch.Tensor, ...]:
    """``products`` with ``rope`` (``apply_rope``'s signature) applied to each one that
    ``rope_heads`` names, per head, in place: the RoPE half of :func:`stacked_linear`."""
    if rope_heads is None:
        return products
    for y, head in zip(products, rope_heads):
        if head:
            heads = y.view(y.shape[0], y.shape[1] // head, head)
            tail = heads[..., head - cos_sin.shape[1]:]
            rope(tail, positions, cos_sin, out=tail)
    return products


def check_stacked_linear(x: Operand, weights: Sequence[Operand], positions: torch.Tensor | None = None,
                         cos_sin: torch.Tensor | None = None, rope_heads: Sequence[int] | None = None,
                         norm_weight: torch.Tensor | None = None, keep_normed: bool = False,
                         norm_dtype: torch.dtype | None = None, swiglu: bool = False,
                         mxfp4_products: Sequence[int] = ()) -> None:
    """At least one weight, each ``[N_i, K]`` with ``x``'s ``K``; with ``rope_heads``, ``x [T, K]``,
    one head width per weight, each 0 or at least ``R`` and dividing ``N_i``, and ``positions``
    and ``cos_sin`` as ``apply_rope`` takes them; ``norm_weight`` ``[K]`` with a plain ``x``, and
    with ``keep_normed``; with ``swiglu`` at least two weights, the last two of one width, and no
    ``rope_heads``; ``mxfp4_products`` distinct indices of products (after the SwiGLU) whose widths
    are multiples of 32."""
    x_shape = logical_shape(x, "x", ACTIVATION_FORMATS)
    if (keep_normed or norm_dtype is not None) and norm_weight is None:
        raise ValueError("stacked_linear: keep_normed and norm_dtype are about the normalised input, so they need "
                         "norm_weight")
    if norm_weight is not None and (not isinstance(x, torch.Tensor) or norm_weight.shape != (x_shape[-1],)):
        raise ValueError(f"stacked_linear: norm_weight must be [K={x_shape[-1]}] with a plain tensor x, got "
                         f"{tuple(norm_weight.shape)} and x of type {type(x).__name__}")
    if isinstance(weights, torch.Tensor) or not len(weights):
        raise ValueError("stacked_linear expects a non-empty sequence of weights [N_i, K]; for one weight "
                         "tensor call linear")
    widths = []
    for i, weight in enumerate(weights):
        w_shape = logical_shape(weight, f"weights[{i}]", WEIGHT_FORMATS)
        if len(x_shape) < 1 or len(w_shape) != 2 or w_shape[1] != x_shape[-1]:
            raise ValueError(f"stacked_linear expects x [..., K] and weights [N_i, K]; got x {tuple(x_shape)}, "
                             f"weights[{i}] {tuple(w_shape)}")
        widths.append(w_shape[0])
    if swiglu and (len(widths) < 2 or widths[-1] != widths[-2] or rope_heads is not None):
        raise ValueError(f"stacked_linear: swiglu takes the last two weights as a gate and an up projection of one "
                         f"width, without rope_heads; got widths {widths} and rope_heads {rope_heads}")
    outputs = widths[:-1] if swiglu else widths
    if len(set(mxfp4_products)) != len(mxfp4_products) or any(
            not isinstance(i, int) or not 0 <= i < len(outputs) or outputs[i] % 32 for i in mxfp4_products):
        raise ValueError(f"stacked_linear: mxfp4_products must be distinct indices of products whose widths are "
                         f"multiples of 32 (widths {outputs}); got {list(mxfp4_products)}")
    if rope_heads is None:
        if positions is not None or cos_sin is not None:
            raise ValueError("stacked_linear: positions and cos_sin go with rope_heads (one head width per "
                             "weight, 0 for none); pass all three or none")
        return
    if positions is None or cos_sin is None:
        raise ValueError("stacked_linear: rope_heads needs positions (int64 [T]) and cos_sin ([P, R])")
    if len(x_shape) != 2:
        raise ValueError(f"stacked_linear with rope_heads expects x [T, K], got {tuple(x_shape)}")
    if len(rope_heads) != len(widths):
        raise ValueError(f"stacked_linear: rope_heads must give one head width per weight ({len(widths)}), "
                         f"got {len(rope_heads)}")
    rope_dim = cos_sin.shape[1] if cos_sin.dim() == 2 else 0
    for i, (head, width) in enumerate(zip(rope_heads, widths)):
        if head and (head < rope_dim or width % head):
            raise ValueError(f"stacked_linear: rope_heads[{i}]={head} must be 0 or a head width of at least "
                             f"rope_dim={rope_dim} that divides the product's width {width}")
    probe = torch.empty(x_shape[0], 1, rope_dim or 2, device=positions.device)
    check_rope_args(probe, positions, cos_sin)


def _case(lead, widths, k, formats=None, dtype=torch.float32, rope_heads=None, rope_dim=64, norm=False,
          swiglu=None, out_dtype=None, mxfp4=()):
    def make(gen: torch.Generator, device: torch.device):
        args = {"x": _operand((*lead, k), None, gen, device, dtype),
                "weights": [_operand((n, k), fmt, gen, device, dtype, spread=k ** -0.5)
                            for n, fmt in zip(widths, formats or [None] * len(widths))]}
        if rope_heads is not None:
            args.update(positions=torch.randint(0, 4096, lead, generator=gen).to(device), rope_heads=rope_heads,
                        cos_sin=rope_cos_sin(rope_inv_freq(10000.0, rope_dim), 4096).to(device))
        if norm:  # inputs far from unit scale, so the normalisation matters
            args["x"] = args["x"] * 7.0
            args.update(norm_weight=(1 + torch.rand(k, generator=gen)).to(device, dtype), norm_eps=1e-6,
                        keep_normed=norm == "keep")
            if norm == "bf16":  # float32 rows normalised, rounded to the bf16 weights' dtype
                args.update(weights=[w.to(torch.bfloat16) for w in args["weights"]], norm_dtype=torch.bfloat16)
        if swiglu is not None:  # the limit, or 0 for none
            args.update(swiglu=True, swiglu_limit=swiglu or None)
        if out_dtype is not None:
            args["out_dtype"] = out_dtype
        if mxfp4:
            args["mxfp4_products"] = mxfp4
        return args
    return make


register(OpSpec(
    name="stacked_linear",
    summary="several linears of one input (one launch can stream every weight)",
    reference=stacked_linear,
    cases=(
        OpCase("tiny", _case((2, 3), (16, 32, 48), 64)),
        OpCase("tiny_bf16", _case((1,), (64, 16, 32), 96, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("rows_bf16", _case((20,), (32, 48), 128, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("no_rows_bf16", _case((0,), (16, 16), 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("odd_widths_bf16", _case((3,), (24, 40, 8), 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("many_bf16", _case((4,), (16,) * 7, 32, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("bf16_x_fp8_weight", _case((2,), (32, 16), 128, ("fp8", None), torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_attention_input_bf16", _case((1,), (1280, 512, 64, 512, 512), 4096, dtype=torch.bfloat16),
               "real", torch.bfloat16),
        OpCase("v41_q_b_bf16", _case((16,), (32768, 8192), 1280, dtype=torch.bfloat16), "real", torch.bfloat16),
        OpCase("tiny_rope", _case((3,), (64, 48, 32), 96, rope_heads=(32, 0, 16), rope_dim=8)),
        OpCase("tiny_rope_bf16", _case((5,), (64, 48, 32), 96, dtype=torch.bfloat16, rope_heads=(32, 0, 16),
                                       rope_dim=16), dtype=torch.bfloat16),
        OpCase("rows_rope_bf16", _case((20,), (128, 64), 64, dtype=torch.bfloat16, rope_heads=(64, 64)),
               dtype=torch.bfloat16),
        OpCase("tiny_norm", _case((3,), (32, 16), 64, norm=True)),
        OpCase("tiny_norm_rope_bf16", _case((4,), (64, 32), 96, dtype=torch.bfloat16, rope_heads=(32, 0), rope_dim=16,
                                            norm=True), dtype=torch.bfloat16),
        OpCase("rows_norm_bf16", _case((20,), (32, 48), 128, dtype=torch.bfloat16, norm=True), dtype=torch.bfloat16),
        OpCase("tiny_float32_normed_to_bf16", _case((2,), (32,), 64, norm="bf16"), dtype=torch.bfloat16),
        OpCase("tiny_keep_normed_bf16", _case((3,), (16, 32, 32), 64, dtype=torch.bfloat16, norm="keep"),
               dtype=torch.bfloat16),
        OpCase("rows_keep_normed_bf16", _case((17,), (16, 32), 64, dtype=torch.bfloat16, norm="keep"),
               dtype=torch.bfloat16),
        OpCase("v41_q_norm_rope_bf16", _case((1,), (32768, 8192), 1024, dtype=torch.bfloat16, rope_heads=(512, 128),
                                             norm=True), "real", torch.bfloat16),
        OpCase("v41_attention_input_norm_bf16", _case((4,), (1280, 512, 64, 512, 512), 4096, dtype=torch.bfloat16,
                                                      norm=True), "real", torch.bfloat16),
        OpCase("tiny_swiglu", _case((3,), (16, 32, 32), 64, swiglu=0)),
        OpCase("tiny_norm_swiglu_bf16", _case((2,), (16, 64, 64), 96, dtype=torch.bfloat16, norm="keep", swiglu=1.0),
               dtype=torch.bfloat16),
        OpCase("rows_swiglu_bf16", _case((18,), (32, 32), 64, dtype=torch.bfloat16, swiglu=0.5),
               dtype=torch.bfloat16),
        OpCase("v41_moe_input_bf16", _case((4,), (16, 2048, 2048), 4096, dtype=torch.bfloat16, norm="keep",
                                           swiglu=10.0), "real", torch.bfloat16),
        OpCase("v41_q_b_rope_bf16", _case((16,), (32768, 8192), 1280, dtype=torch.bfloat16, rope_heads=(512, 128)),
               "real", torch.bfloat16),
        OpCase("tiny_mxfp4_bf16", _case((3,), (64, 32), 96, dtype=torch.bfloat16, mxfp4=(1,)), dtype=torch.bfloat16),
        OpCase("rows_norm_rope_mxfp4_bf16", _case((18,), (128, 64), 64, dtype=torch.bfloat16, rope_heads=(64, 32),
                                                  rope_dim=16, norm=True, mxfp4=(0, 1)), dtype=torch.bfloat16),
        OpCase("v41_q_b_index_mxfp4_bf16", _case((4,), (32768, 8192), 1024, dtype=torch.bfloat16,
                                                 rope_heads=(512, 128), norm=True, mxfp4=(1,)), "real", torch.bfloat16),
        # LM heads: float32 products of bf16 operands, held to float32's tolerance (the normalised input
        # is left out there, since one bf16 step of it moves a product by more)
        OpCase("head_float32_bf16", _case((2,), (128, 64), 256, dtype=torch.bfloat16, out_dtype=torch.float32),
               dtype=torch.bfloat16, tolerance=FLOAT32_OUTPUT),
        OpCase("rows_head_float32_bf16", _case((24,), (192,), 128, dtype=torch.bfloat16, out_dtype=torch.float32),
               dtype=torch.bfloat16, tolerance=FLOAT32_OUTPUT),
        OpCase("head_norm_float32_bf16", _case((3,), (128,), 256, dtype=torch.bfloat16, norm=True,
                                               out_dtype=torch.float32), dtype=torch.bfloat16),
        OpCase("v41_head_float32_bf16", _case((4,), (16384,), 4096, dtype=torch.bfloat16, out_dtype=torch.float32),
               "real", torch.bfloat16, FLOAT32_OUTPUT),
    ),
))
