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
from deepinfer_backends.ascend950.emulate.plan import BlockPlan, WriteRecord
from deepinfer_backends.ascend950.emulate.rms_norm import rms_norm, row_tile


def kv_norm_rope_store(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       cos_sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fmt: str,
                       platform: str = "A5") -> torch.Tensor:
    """:func:`deepinfer.hal.ops.kv_norm_rope_store.kv_norm_rope_store` as the ascend950 kernel plans it."""
    spec = token_format(fmt)
    if x.dim() != 2 or x.shape[1] != spec.dim or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [T, {spec.dim}] for format {fmt!r}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows = row_tile(spec.dim, x.element_size(), platform)
    out = torch.empty_like(x)
    record = WriteRecord(x.shape[0], 1)
    plan = BlockPlan(2 * AI_CORES[platform])
    for r0 in range(0, x.shape[0], rows):
        plan.add((r0, min(r0 + rows, x.shape[0])))
    for core_tiles in plan.per_core():
        for r0, r1 in core_tiles:
            keys = apply_rope(rms_norm(x[r0:r1], weight, eps, platform=platform), positions[r0:r1], cos_sin)
            kv_store(cache, slots[r0:r1], keys, fmt)
            out[r0:r1] = kv_cast(keys, fmt).to(x.dtype)
            record.store(slice(r0, r1), slice(0, 1))
    record.check(x.shape[0])
    return out
