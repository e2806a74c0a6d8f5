"""Emulated ascend950 fused KV store: rows spread over the vector cores in UB tiles; each tile is
normalised (the RMSNorm emulation's reduction, rounded to the rows' dtype as the unfused ops
round), rotated in float32, quantized to the cache format (FP8 with UE8M0 scales, FP4 with e4m3
scales, as the A5 formats hold them) and written to its cache rows."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import kv_cast, kv_store
from deepinfer.hal.ops.rope import apply_rope
from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate.plan import run_row_tiles
from deepinfer_backends.ascend950.emulate.rms_norm import rms_norm, row_tile


def kv_norm_rope_store(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       cos_sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fmt: str,
                       platform: str = "A5") -> torch.Tensor:
    """:func:`deepinfer.hal.ops.kv_norm_rope_store.kv_norm_rope_store` as the ascend950 kernel plans it."""
    spec = token_format(fmt)
    if x.dim() != 2 or x.shape[1] != spec.dim or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [T, {spec.dim}] for format {fmt!r}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    out = torch.empty_like(x)

    def store(first: int, end: int) -> None:
        keys = apply_rope(rms_norm(x[first:end], weight, eps, platform=platform), positions[first:end], cos_sin)
        kv_store(cache, slots[first:end], keys, fmt)
        out[first:end] = kv_cast(keys, fmt).to(x.dtype)
    run_row_tiles(x.shape[0], row_tile(spec.dim, x.element_size(), platform), 2 * AI_CORES[platform], store)
    return out
