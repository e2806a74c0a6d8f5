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
from deepinfer.hal.ops.rope import apply_rope, check_rope_args, rope_cos_sin, rope_inv_freq
from deepinfer.hal.spec import OpCase, OpSpec, register


def grouped_linear(x: Operand, weight: Operand, positions: torch.Tensor | None = None,
                   cos_sin: torch.Tensor | None = None, rope_head: int = 0, conjugate: bool = False,
                   rope_in_place: bool = False) -> torch.Tensor:
    """``y [T, G, N]`` with ``y[t, g] = x[t, g] @ weight[g].T`` for ``x [T, G, K]`` and
    ``weight [G, N, K]`` (plain or :class:`Quantized` as :func:`grouped_gemm` takes them).

    Exactly :func:`grouped_gemm` on the group-major rows ``x.transpose(0, 1)`` with ``T`` rows a
    group: float32 accumulation, the result in ``x.dtype`` for plain operands, float32 if either
    is quantized.

    With ``rope_head`` > 0 (a plain ``x``; ``positions`` and ``cos_sin`` as
    :func:`~deepinfer.hal.ops.rope.apply_rope` takes them) ``x``, seen as heads ``rope_head`` wide,
    first has each head's trailing ``R`` dims turned by ``apply_rope`` (``conjugate``: backwards,
    the attention output's inverse rotation), which a backend may do as it loads ``x``. With
    ``rope_in_place`` the caller gives ``x`` up as scratch: a backend may turn the heads where they
    lie instead of writing a turned copy, so ``x``'s values afterwards are unspecified."""
    tokens, groups = check_grouped_linear(x, weight, positions, cos_sin, rope_head)
    if rope_head:
        x = rope_heads_of(x, positions, cos_sin, rope_head, conjugate, in_place=rope_in_place)
    sizes = torch.full((groups,), tokens, dtype=torch.int64, device=_data(weight).device)
    out = grouped_gemm(group_major(x), weight, sizes)
    return out.view(groups, tokens, out.shape[-1]).transpose(0, 1).contiguous()


def rope_heads_of(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head: int,
                  conjugate: bool, rope=apply_rope, in_place: bool = False) -> torch.Tensor:
    """``x [T, G, K]`` with ``rope`` (``apply_rope``'s signature) applied to each ``head``-wide
    head's trailing dims: the RoPE half of :func:`grouped_linear`. In a new tensor, or with
    ``in_place`` in ``x`` itself (only the turned dims are read and written; an ``x`` whose heads
    cannot be viewed in place is turned in a copy)."""
    heads = x.reshape(x.shape[0], -1, head)
    if not in_place:
        return rope(heads, positions, cos_sin, conjugate=conjugate).view(x.shape)
    tail = heads[..., head - cos_sin.shape[1]:]
    rope(tail, positions, cos_sin, conjugate=conjugate, out=tail)
    return heads.view(x.shape)


def check_grouped_linear(x: Operand, weight: Operand, positions: torch.Tensor | None = None,
                         cos_sin: torch.Tensor | None = None, rope_head: int = 0) -> tuple[int, int]:
    """``(T, G)`` after checking ``x [T, G, K]`` against ``weight [G, N, K]``, and with
    ``rope_head`` a plain ``x`` whose ``K`` it divides, ``positions`` and ``cos_sin``."""
    x_shape = logical_shape(x, "x", ACTIVATION_FORMATS)
    w_shape = logical_shape(weight, "weight", WEIGHT_FORMATS)
    if len(x_shape) != 3 or len(w_shape) != 3 or x_shape[1] != w_shape[0] or x_shape[2] != w_shape[2]:
        raise ValueError(f"grouped_linear expects x [T, G, K] and weight [G, N, K]; got x {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}")
    if rope_head:
        if positions is None or cos_sin is None or isinstance(x, Quantized):
            raise ValueError("grouped_linear: rope_head needs a plain x, positions (int64 [T]) and cos_sin ([P, R])")
        if x_shape[2] % rope_head or rope_head < cos_sin.shape[-1]:
            raise ValueError(f"grouped_linear: rope_head={rope_head} must divide K={x_shape[2]} and be at least "
                             f"rope_dim={cos_sin.shape[-1]}")
        check_rope_args(x, positions, cos_sin)
    elif positions is not None or cos_sin is not None:
        raise ValueError("grouped_linear: positions and cos_sin go with rope_head (the heads' width); pass all three")
    return x_shape[0], x_shape[1]


def group_major(x: Operand) -> Operand:
    """``x [T, G, K]`` as the ``[G * T, K]`` rows of a grouped GEMM (group by group; copied)."""
    if isinstance(x, Quantized):
        return Quantized(group_major(x.data), group_major(x.scale), x.fmt, x.block)
    tokens, groups = x.shape[:2]
    return x.transpose(0, 1).reshape(groups * tokens, x.shape[2])


def _data(operand: Operand) -> torch.Tensor:
    return operand.data if isinstance(operand, Quantized) else operand


def _case(tokens, groups, n, k, x_fmt=None, w_fmt=None, dtype=torch.float32, rope_head=0, rope_dim=64,
          in_place=False):
    def make(gen: torch.Generator, device: torch.device):
        args = {"x": _operand((tokens, groups, k), x_fmt, gen, device, dtype),
                "weight": _operand((groups, n, k), w_fmt, gen, device, dtype, spread=k ** -0.5)}
        if rope_head:
            args.update(positions=torch.randint(0, 4096, (tokens,), generator=gen).to(device), rope_head=rope_head,
                        cos_sin=rope_cos_sin(rope_inv_freq(10000.0, rope_dim), 4096).to(device), conjugate=True,
                        rope_in_place=in_place)
        return args
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
        OpCase("tiny_rope", _case(3, 2, 16, 64, rope_head=32, rope_dim=8)),
        OpCase("tiny_rope_bf16", _case(5, 3, 32, 96, dtype=torch.bfloat16, rope_head=48, rope_dim=16),
               dtype=torch.bfloat16),
        OpCase("rows_rope_bf16", _case(20, 2, 32, 128, dtype=torch.bfloat16, rope_head=64), dtype=torch.bfloat16),
        OpCase("rows_rope_in_place_bf16", _case(20, 2, 32, 128, dtype=torch.bfloat16, rope_head=64, in_place=True),
               dtype=torch.bfloat16),
        OpCase("v41_o_proj_bf16", _case(16, 8, 512, 4096, dtype=torch.bfloat16), "real", torch.bfloat16),
        OpCase("v41_o_proj_rope_bf16", _case(1, 8, 512, 4096, dtype=torch.bfloat16, rope_head=512), "real",
               torch.bfloat16),
        OpCase("v41_o_proj_rope_in_place_bf16", _case(64, 8, 512, 4096, dtype=torch.bfloat16, rope_head=512,
                                                      in_place=True), "real", torch.bfloat16),
        OpCase("v41_o_proj_fp8_weight_bf16", _case(16, 8, 512, 4096, None, "fp8", torch.bfloat16), "real",
               torch.bfloat16),
    ),
))
