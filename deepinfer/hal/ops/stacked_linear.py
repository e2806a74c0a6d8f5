"""Several linears of one input, ``tuple(linear(x, w) for w in weights)``: the projections a layer
takes from the same hidden state (DeepInfer fuses them in one GEMM: the query's ``q_a`` with the
SWA key's ``wkv``, the compressor with the indexer's head weights, ``q_b`` with the indexer's
queries, the shared expert's gate and up).

One op, so a backend can read the input once and stream every weight in one launch; each product
is its own tensor, as :func:`~deepinfer.hal.ops.grouped_gemm.linear` would return it."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.hal.ops.grouped_gemm import (ACTIVATION_FORMATS, WEIGHT_FORMATS, Operand, _operand, linear,
                                            logical_shape)
from deepinfer.hal.spec import OpCase, OpSpec, register


def stacked_linear(x: Operand, weights: Sequence[Operand]) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x, w) for w in weights)``: ``x [..., K]``, each ``weight [N_i, K]`` plain or
    :class:`~deepinfer.hal.formats.Quantized` as :func:`linear` takes it; each product
    ``[..., N_i]`` in :func:`linear`'s dtype (``x.dtype`` for plain operands, float32 if quantized)."""
    check_stacked_linear(x, weights)
    return tuple(linear(x, w) for w in weights)


def check_stacked_linear(x: Operand, weights: Sequence[Operand]) -> None:
    """At least one weight, each ``[N_i, K]`` with ``x``'s ``K``."""
    x_shape = logical_shape(x, "x", ACTIVATION_FORMATS)
    if isinstance(weights, torch.Tensor) or not len(weights):
        raise ValueError("stacked_linear expects a non-empty sequence of weights [N_i, K]; for one weight "
                         "tensor call linear")
    for i, weight in enumerate(weights):
        w_shape = logical_shape(weight, f"weights[{i}]", WEIGHT_FORMATS)
        if len(x_shape) < 1 or len(w_shape) != 2 or w_shape[1] != x_shape[-1]:
            raise ValueError(f"stacked_linear expects x [..., K] and weights [N_i, K]; got x {tuple(x_shape)}, "
                             f"weights[{i}] {tuple(w_shape)}")


def _case(lead, widths, k, formats=None, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        return {"x": _operand((*lead, k), None, gen, device, dtype),
                "weights": [_operand((n, k), fmt, gen, device, dtype, spread=k ** -0.5)
                            for n, fmt in zip(widths, formats or [None] * len(widths))]}
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
    ),
))
