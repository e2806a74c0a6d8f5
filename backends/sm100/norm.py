"""sm100 row-wise wrappers (HAL ``rms_norm`` and the fused ``kv_norm_rope_store``): one CTA per row."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import cache_rows
from deepinfer_backends.sm100.launch import compiled, float32_param, require


def rms_norm(x, weight, eps, residual=None):
    """HAL ``rms_norm`` (+ residual): one CTA per row, float32 math, bf16 or float32 rows."""
    op = "rms_norm"
    require(x.is_cuda and x.dim() >= 1, op, f"x must be a CUDA tensor, got {x.device}")
    dim = x.shape[-1]
    require(dim % 32 == 0, op, f"the last dim ({dim}) must be a multiple of 32")
    if weight.shape != (dim,):
        raise ValueError(f"{op}: weight must be [{dim}], got {tuple(weight.shape)}")
    from deepinfer_backends.sm100.kernels.rms_norm import tl_dtype

    threads = next((t for t in (256, 128, 64) if dim % t == 0 and dim // t >= 4), 32)
    flat = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(flat)
    residual_dtype = None if residual is None else tl_dtype(residual.dtype)
    kernel = compiled("rms_norm", "rms_norm", dim, float(eps), tl_dtype(x.dtype), residual_dtype, threads=threads)
    if residual is None:
        if flat.shape[0]:
            kernel(flat, float32_param(weight), out)
        return out.reshape(x.shape)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    residual_flat = residual.reshape(-1, dim).contiguous()
    residual_out = torch.empty_like(residual_flat)
    if flat.shape[0]:
        kernel(flat, residual_flat, float32_param(weight), out, residual_out)
    return out.reshape(x.shape), residual_out.reshape(x.shape)


KV_STORE_FORMATS = ("fp8", "bf16", "fp4", "index_fp4")
"""The cache formats ``kernels/kv_norm_rope_store.py`` encodes (named here so a refusal needs no tilelang)."""


def kv_norm_rope_store(x, weight, eps, positions, cos_sin, cache, slots, fmt):
    """HAL ``kv_norm_rope_store``: one CTA per token normalises, rotates, encodes and stores the
    row and writes its decoded copy; bf16 or float32 ``x [T, dim]``, cache rows ``fp8`` (528 B),
    ``bf16``, ``fp4`` (288 B) or ``index_fp4`` (68 B, dim 128). Positions and slots are not
    range-checked on the device (that would cost a host sync): a slot past the cache is not
    stored, and a position past the table rotates by zeros."""
    op = "kv_norm_rope_store"
    require(fmt in KV_STORE_FORMATS, op, f"cache format {fmt!r} is not implemented ({', '.join(KV_STORE_FORMATS)} "
                                          f"are)")
    require(isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.bfloat16, torch.float32), op,
             f"x must be a bfloat16 or float32 CUDA tensor, got "
             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__} on "
             f"{x.device if isinstance(x, torch.Tensor) else '-'}")
    dim = token_format(fmt).dim
    if x.dim() != 2 or x.shape[1] != dim or weight.shape != (dim,):
        raise ValueError(f"{op}: expects x [T, {dim}] and weight [{dim}] for format {fmt!r}; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    for name, index in (("positions", positions), ("slots", slots)):
        if index.dtype != torch.int64 or index.shape != (x.shape[0],):
            raise ValueError(f"{op}: {name} must be int64 [T={x.shape[0]}], got {index.dtype} {tuple(index.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or not cos_sin.is_floating_point():
        raise ValueError(f"{op}: cos_sin must be a float [P, rope_dim] table with even rope_dim, got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")
    rope_dim = cos_sin.shape[1]
    require(rope_dim % 8 == 0 and rope_dim <= dim, op, f"rope_dim={rope_dim} must be a multiple of 8 up to {dim}")
    require(all(t.is_cuda for t in (weight, positions, cos_sin, cache, slots)), op,
             "weight, positions, cos_sin, cache and slots must be CUDA tensors")
    rows = cache_rows(cache, token_format(fmt))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        kernel = compiled("kv_norm_rope_store", "kv_norm_rope_store", dim, rope_dim, float(eps), fmt,
                          "bfloat16" if x.dtype == torch.bfloat16 else "float32")
        kernel(x.contiguous(), float32_param(weight), positions.contiguous(), cos_sin.float().contiguous(),
               slots.contiguous(), rows.view(torch.bfloat16) if fmt == "bf16" else rows, y)
    return y
