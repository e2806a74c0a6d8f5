"""Native ascend950 RoPE and fused KV store: :mod:`~deepinfer_backends.ascend950.kernels.apply_rope`
turns bf16 rows in place (on a copy padded with whole tokens to whole tiles of the emulation's
:func:`~deepinfer_backends.ascend950.emulate.apply_rope.row_tile`, the padding at position 0);
:mod:`~deepinfer_backends.ascend950.kernels.kv_norm_rope_store` normalises, turns and stores bf16
keys in a cache of every token format (rows padded to whole tiles of
:func:`~deepinfer_backends.ascend950.emulate.kv_norm_rope_store.row_tile`, the padding at slot
``-1``, never stored)."""
from __future__ import annotations

import math

import torch

from deepinfer.hal.formats import FP8_AMAX_FLOOR, MXFP4_AMAX_FLOOR, NVFP4_AMAX_FLOOR, token_format
from deepinfer.hal.ops.kv_cache import cache_rows, check_slots
from deepinfer.hal.ops.rope import check_rope_args
from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate import apply_rope as rope_plan
from deepinfer_backends.ascend950.emulate import kv_norm_rope_store as store_plan
from deepinfer_backends.ascend950.kernels.kv_norm_rope_store import BF16_FORMATS
from deepinfer_backends.ascend950.native.launch import (Kernels, check_device, padded, plan_offsets, refuse, round_up,
                                                       whole)

ROPE, STORE = "apply_rope", "kv_norm_rope_store"
AMAX_FLOORS = {"fp8": FP8_AMAX_FLOOR, "index_fp4": MXFP4_AMAX_FLOOR, "fp4": NVFP4_AMAX_FLOOR}
"""The least block max each quantized format's scale is taken from."""


def apply_rope(kernels: Kernels, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               conjugate: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`deepinfer.hal.ops.rope.apply_rope` on the NPU for bf16 rows."""
    check_rope_args(x, positions, cos_sin, out)
    if x.dtype != torch.bfloat16:
        raise refuse(ROPE, f"the kernel turns bf16 rows, got {x.dtype}")
    rope_dim = cos_sin.shape[1]
    if rope_dim * x.element_size() % 32:
        raise refuse(ROPE, f"the kernel moves the rotated columns in 32-byte blocks: {rope_dim} bf16 values are not "
                           f"a multiple of 32 B")
    check_device(ROPE, x=x, positions=positions, cos_sin=cos_sin, out=out)
    tokens, dim = x.shape[0], x.shape[-1]
    if x.numel() == 0:
        return x.clone() if out is None else out
    heads = x[0].numel() // dim
    tile = rope_plan.row_tile(rope_dim, x.element_size(), kernels.platform)
    whole_tokens = round_up(tokens, tile // math.gcd(heads, tile))
    platform = kernels.platform
    kernel = kernels.get(ROPE, dict(tokens=whole_tokens, heads=heads, dim=dim, rope_dim=rope_dim,
                                    table_rows=cos_sin.shape[0], tile_rows=tile, vector_cores=2 * AI_CORES[platform],
                                    offsets=plan_offsets(ROPE, rope_plan.plan_buffers(tile, rope_dim, 2), platform),
                                    conjugate=bool(conjugate), dtype="bfloat16"))
    rows = padded(x.reshape(tokens * heads, dim), (whole_tokens * heads, dim))
    kernel(rows, whole(positions.to(torch.int32), (whole_tokens,)), cos_sin.float().contiguous())
    result = rows[:tokens * heads].view(x.shape)
    return result if out is None else out.copy_(result)


def kv_norm_rope_store(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       cos_sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fmt: str) -> torch.Tensor:
    """:func:`deepinfer.hal.ops.kv_norm_rope_store.kv_norm_rope_store` on the NPU for bf16 rows
    stored in a cache of any token format (:data:`deepinfer.hal.formats.TOKEN_FORMATS`)."""
    spec = token_format(fmt)
    if x.dim() != 2 or x.shape[1] != spec.dim or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [T, {spec.dim}] for format {fmt!r}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise refuse(STORE, f"the kernel takes bf16 rows, got {x.dtype}")
    if weight.shape != (spec.dim,):
        raise ValueError(f"weight must be [{spec.dim}] (the norm over x's last dim), got {tuple(weight.shape)}")
    check_rope_args(x, positions, cos_sin)
    rows = cache_rows(cache, spec)
    rows = rows if fmt in AMAX_FLOORS else rows.view(torch.bfloat16)
    check_slots(slots, rows.shape[0])
    if slots.shape != (x.shape[0],):
        raise ValueError(f"slots must be [T={x.shape[0]}], got {tuple(slots.shape)}")
    check_device(STORE, x=x, weight=weight, positions=positions, cos_sin=cos_sin, cache=cache, slots=slots)
    tokens, dim, rope_dim = x.shape[0], spec.dim, cos_sin.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    platform = kernels.platform
    tile = store_plan.row_tile(dim, rope_dim, x.element_size(), fmt, platform)
    whole_rows = round_up(tokens, tile)
    buffers = store_plan.plan_buffers(tile, dim, rope_dim, x.element_size(), fmt)
    kernel = kernels.get(STORE, dict(rows=whole_rows, dim=dim, rope_dim=rope_dim, table_rows=cos_sin.shape[0],
                                     cache_rows=rows.shape[0], tile_rows=tile, vector_cores=2 * AI_CORES[platform],
                                     eps=float(eps), fmt=fmt, offsets=plan_offsets(STORE, buffers, platform),
                                     dtype="bfloat16", amax_floor=AMAX_FLOORS.get(fmt, FP8_AMAX_FLOOR)), out_idx=[6])
    out = kernel(whole(x, (whole_rows, dim)), weight.float().reshape(1, dim).contiguous(),
                 whole(positions.to(torch.int32), (whole_rows,)), cos_sin.float().contiguous(),
                 whole(slots.to(torch.int32), (whole_rows,), -1), rows)
    return out[:tokens]
