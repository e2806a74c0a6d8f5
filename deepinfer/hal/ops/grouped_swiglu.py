"""The routed experts' first half: gate and up grouped GEMMs over the same rows, joined by the
clamped SwiGLU, ``swiglu(grouped_gemm(x, w1), grouped_gemm(x, w3))``.

One op, so a backend can stream both weights in one pass and apply the activation before
anything is stored (the two products and the activation's input never reach memory)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.activation import swiglu
from deepinfer.hal.ops.grouped_gemm import (ACTIVATION_FORMATS, WEIGHT_FORMATS, Operand, _operand, grouped_gemm,
                                            logical_shape)
from deepinfer.hal.spec import OpCase, OpSpec, register


def grouped_swiglu(x: Operand, w1: Operand, w3: Operand, group_sizes: torch.Tensor, limit: float | None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``swiglu(grouped_gemm(x, w1, group_sizes), grouped_gemm(x, w3, group_sizes), limit, dtype)``.

    ``w1`` (gate) and ``w3`` (up) are ``[E, N, K]`` weights of the same shape and format, taken
    as :func:`~deepinfer.hal.ops.grouped_gemm.grouped_gemm` takes them; each product is rounded
    to that op's result dtype (``x.dtype`` for plain operands, float32 if quantized) before the
    activation, which computes in float32 and rounds once to ``dtype`` (default: that result
    dtype). Result ``[M, N]``; rows after the last segment are not computed."""
    check_grouped_swiglu(x, w1, w3, limit)
    return swiglu(grouped_gemm(x, w1, group_sizes), grouped_gemm(x, w3, group_sizes), limit, dtype)


def check_grouped_swiglu(x: Operand, w1: Operand, w3: Operand, limit: float | None) -> None:
    """The checks beyond the grouped GEMMs' own: the two weights alike, the limit positive."""
    shapes = [logical_shape(w, name, WEIGHT_FORMATS) for w, name in ((w1, "w1"), (w3, "w3"))]
    kinds = [w.fmt if isinstance(w, Quantized) else w.dtype for w in (w1, w3)]
    if shapes[0] != shapes[1] or kinds[0] != kinds[1]:
        raise ValueError(f"w1 and w3 must have the same shape and format, got {tuple(shapes[0])} {kinds[0]} and "
                         f"{tuple(shapes[1])} {kinds[1]}")
    logical_shape(x, "x", ACTIVATION_FORMATS)
    if limit is not None and not limit > 0:
        raise ValueError(f"limit must be positive (or None: no clamping), got {limit!r}")


def _case(sizes, n, k, x_fmt=None, w_fmt=None, dtype=torch.float32, limit: float | None = 7.0, out=None):
    def make(gen: torch.Generator, device: torch.device):
        return {"x": _operand((sum(sizes), k), x_fmt, gen, device, dtype),
                "w1": _operand((len(sizes), n, k), w_fmt, gen, device, dtype, spread=4 * k ** -0.5),
                "w3": _operand((len(sizes), n, k), w_fmt, gen, device, dtype, spread=4 * k ** -0.5),
                "group_sizes": torch.tensor(sizes, dtype=torch.int64, device=device), "limit": limit, "dtype": out}
    return make


register(OpSpec(
    name="grouped_swiglu",
    summary="gate and up grouped GEMMs joined by the clamped SwiGLU (the routed experts' first half)",
    reference=grouped_swiglu,
    cases=(
        OpCase("tiny", _case((3, 1, 4), 16, 64)),
        OpCase("tiny_no_limit", _case((2, 0, 3), 24, 32, limit=None)),
        OpCase("tiny_bf16", _case((2, 5), 24, 96, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("decode_bf16", _case((1, 0, 0, 1, 1, 0, 2, 1), 48, 128, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("empty_experts_bf16", _case((0, 3, 0, 0, 70, 0), 40, 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("no_rows_bf16", _case((0, 0), 16, 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("bf16_x_fp8_weight", _case((3, 0, 5), 24, 128, None, "fp8", torch.bfloat16, out=torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("tiny_fp8_mxfp4", _case((4, 2), 8, 128, "fp8", "mxfp4", out=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_decode_bf16", _case((1, 0, 1, 2, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), 2048, 4096,
                                        dtype=torch.bfloat16), "real", torch.bfloat16),
        OpCase("long_segments_bf16", _case((130, 0, 7, 64), 256, 160, dtype=torch.bfloat16, limit=None),
               dtype=torch.bfloat16),
        OpCase("v41_experts_bf16", _case((20, 0, 31, 13), 2048, 4096, dtype=torch.bfloat16), "real", torch.bfloat16),
        OpCase("v41_prefill_bf16", _case((300, 41, 0, 187), 2048, 4096, dtype=torch.bfloat16), "real",
               torch.bfloat16),
    ),
))
