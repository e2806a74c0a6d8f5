"""sm100 ``grouped_linear``: cuBLAS's strided batched GEMM reading ``x [T, G, K]`` and writing
``[T, G, N]`` where they lie (bf16 operands), or the grouped GEMM kernels on group-major copies
(block-scaled weights, ``linear_kernel=tilelang``, and the batch-invariant mode); the heads' RoPE
(``rope_head``) by ``apply_rope`` first."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_linear import check_grouped_linear, group_major, rope_heads_of
from deepinfer_backends.sm100.gemm import grouped_gemm
from deepinfer_backends.sm100.launch import cuda_bf16
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions
from deepinfer_backends.sm100.rope import apply_rope


def grouped_linear(x, weight, positions=None, cos_sin=None, rope_head: int = 0, conjugate: bool = False,
                   rope_in_place: bool = False, batch_invariant: bool = False,
                   options: KernelOptions = DEFAULT) -> torch.Tensor:
    """HAL ``grouped_linear``: ``y[t, g] = x[t, g] @ weight[g].T``, with ``rope_head`` after one
    :func:`~.rope.apply_rope` launch that writes the turned heads (and copies the rest) into a new
    tensor, or with ``rope_in_place`` reads and writes only the turned dims of ``x``. bf16
    operands go to cuBLAS (``torch.bmm`` on strided views, no copies) unless
    ``options.linear_kernel`` is ``tilelang`` or ``batch_invariant`` is set (cuBLAS picks its
    kernel by shape); then, and for quantized operands,
    :func:`~deepinfer_backends.sm100.gemm.grouped_gemm` runs on the group-major rows."""
    tokens, groups = check_grouped_linear(x, weight, positions, cos_sin, rope_head)
    plain = not isinstance(x, Quantized) and not isinstance(weight, Quantized)
    if rope_head:
        x = rope_heads_of(x, positions, cos_sin, rope_head, conjugate, rope=apply_rope, in_place=rope_in_place)
    if plain and not batch_invariant and options.linear_kernel != "tilelang":
        cuda_bf16("grouped_linear", "x", x)
        cuda_bf16("grouped_linear", "weight", weight)
        out = torch.empty(tokens, groups, weight.shape[1], dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
        return out
    data = weight.data if isinstance(weight, Quantized) else weight
    sizes = torch.full((groups,), tokens, dtype=torch.int64, device=data.device)
    y = grouped_gemm(group_major(x), weight, sizes, batch_invariant=batch_invariant, options=options)
    return y.view(groups, tokens, y.shape[-1]).transpose(0, 1).contiguous()
