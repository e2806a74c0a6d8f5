"""sm100 ``grouped_linear``: a Triton kernel for few bf16 rows (the heads' RoPE as it loads ``x``),
cuBLAS's strided batched GEMM reading ``x [T, G, K]`` and writing ``[T, G, N]`` where they lie
(other bf16 operands), or the grouped GEMM kernels on group-major copies (block-scaled weights,
``linear_kernel=tilelang``, and the batch-invariant mode)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_linear import check_grouped_linear, group_major, rope_heads_of
from deepinfer_backends.sm100.gemm import grouped_gemm
from deepinfer_backends.sm100.launch import cuda_bf16, on_device
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions
from deepinfer_backends.sm100.rope import apply_rope


def grouped_linear(x, weight, positions=None, cos_sin=None, rope_head: int = 0, conjugate: bool = False,
                   batch_invariant: bool = False, options: KernelOptions = DEFAULT) -> torch.Tensor:
    """HAL ``grouped_linear``: ``y[t, g] = x[t, g] @ weight[g].T``. bf16 operands of at most 16 rows
    go to the Triton kernel for few rows (:mod:`.fused.grouped_linear_skinny`, which turns the
    heads' RoPE as it loads ``x``) under ``options.linear_kernel=auto``; other bf16 operands to
    cuBLAS (``torch.bmm`` on strided views, no copies) unless ``options.linear_kernel`` is
    ``tilelang`` or ``batch_invariant`` is set (cuBLAS picks its kernel by shape); then, and for
    quantized operands, :func:`~deepinfer_backends.sm100.gemm.grouped_gemm` runs on the
    group-major rows. Outside the Triton kernel the RoPE is :func:`~.rope.apply_rope` first."""
    tokens, groups = check_grouped_linear(x, weight, positions, cos_sin, rope_head)
    plain = not isinstance(x, Quantized) and not isinstance(weight, Quantized)
    if plain and not batch_invariant and options.linear_kernel == "auto" and on_device(x) and on_device(weight):
        from deepinfer_backends.sm100.fused.grouped_linear_skinny import grouped_linear_skinny, serves

        if serves(x, weight):
            rope = (positions.contiguous(), cos_sin.float().contiguous(), rope_head, conjugate) if rope_head else None
            return grouped_linear_skinny(x, weight.contiguous(), rope)
    if rope_head:
        x = rope_heads_of(x, positions, cos_sin, rope_head, conjugate, rope=apply_rope)
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
