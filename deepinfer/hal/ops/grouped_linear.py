"""Per-group linears over the groups of each row: ``y[t, g] = x[t, g] @ weight[g].T``.

V4.1's grouped low-rank output projection: each group of heads of a token goes through its own
``[N, K]`` weight (DeepInfer's ``einsum("bhr,hdr->bhd")``). It is :func:`grouped_gemm` with every
group taking every token, read from and written to ``[T, G, .]`` in place of the group-major rows a
grouped GEMM takes, so a backend needs no transposing copies around it."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_gemm import (ACTIVATION_FORMATS, WEIGHT_FORMATS, Operand, _operand, grouped_gemm,
                                            logical_shape)
from deepinfer.hal.spec import OpCase, OpSpec, register


def grouped_linear(x: Operand, weight: Operand) -> torch.Tensor:
    """``y [T, G, N]`` with ``y[t, g] = x[t, g] @ weight[g].T`` for ``x [T, G, K]`` and
    ``weight [G, N, K]`` (plain or :class:`Quantized` as :func:`grouped_gemm` takes them).

    Exactly :func:`grouped_gemm` on the group-major rows ``x.transpose(0, 1)`` with ``T`` rows a
    group: float32 accumulation, the result in ``x.dtype`` for plain operands, float32 if either
    is quantized."""
    tokens, groups = check_grouped_linear(x, weight)
    sizes = torch.full((groups,), tokens, dtype=torch.int64, device=_data(weight).device)
    out = grouped_gemm(group_major(x), weight, sizes)
    return out.view(groups, tokens, out.shape[-1]).transpose(0, 1).contiguous()


def check_grouped_linear(x: Operand, weight: Operand) -> tuple[int, int]:
    """``(T, G)`` after checking ``x [T, G, K]`` against ``weight [G, N, K]``."""
    x_shape = logical_shape(x, "x", ACTIVATION_FORMATS)
    w_shape = logical_shape(weight, "weight", WEIGHT_FORMATS)
    if len(x_shape) != 3 or len(w_shape) != 3 or x_shape[1] != w_shape[0] or x_shape[2] != w_shape[2]:
        raise ValueError(f"grouped_linear expects x [T, G, K] and weight [G, N, K]; got x {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}")
    return x_shape[0], x_shape[1]


def group_major(x: Operand) -> Operand:
    """``x [T, G, K]`` as the ``[G * T, K]`` rows of a grouped GEMM (group by group; copied)."""
    if isinstance(x, Quantized):
        return Quantized(group_major(x.data), group_major(x.scale), x.fmt, x.block)
    tokens, groups = x.shape[:2]
    return x.transpose(0, 1).reshape(groups * tokens, x.shape[2])


def _data(operand: Operand) -> torch.Tensor:
    return operand.data if isinstance(operand, Quantized) else operand


def _case(tokens, groups, n, k, x_fmt=None, w_fmt=None, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        return {"x": _operand((tokens, groups, k), x_fmt, gen, device, dtype),
                "weight": _operand((groups, n, k), w_fmt, gen, device, dtype, spread=k ** -0.5)}
    return make


register(OpSpec(
    name="grouped_linear",
    summary="per-group linears y[t, g] = x[t, g] @ weight[g].T (the grouped output projection)",
    reference=grouped_linear,
    cases=(
        OpCase("tiny", _case(5, 3, 16, 64)),
        OpCase("tiny_bf16", _case(6, 2, 24, 96, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("one_token_bf16", _case(1, 4, 40, 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("no_tokens_bf16", _case(0, 2, 16, 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_fp8_fp8", _case(3, 2, 16, 64, "fp8", "fp8")),
        OpCase("bf16_x_fp8_weight", _case(4, 2, 24, 128, None, "fp8", torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_o_proj_bf16", _case(16, 8, 512, 4096, dtype=torch.bfloat16), "real", torch.bfloat16),
        OpCase("v41_o_proj_fp8_weight_bf16", _case(16, 8, 512, 4096, None, "fp8", torch.bfloat16), "real",
               torch.bfloat16),
    ),
))
