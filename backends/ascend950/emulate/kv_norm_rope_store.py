"""Emulated ascend950 fused KV store: rows spread over the vector cores in UB tiles of
:func:`row_tile` rows; each tile is normalised (the RMSNorm emulation's reduction, rounded to the
rows' dtype as the unfused ops round), rotated in float32 (rounded again), quantized to the cache
format (FP8 with UE8M0 scales, FP4 with e4m3 scales, as the A5 formats hold them) and written to
its cache rows. The native kernel, :mod:`~deepinfer_backends.ascend950.kernels.kv_norm_rope_store`,
runs this plan."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import kv_cast, kv_store
from deepinfer.hal.ops.rope import apply_rope
from deepinfer_backends.ascend950.buffers import AI_CORES, KIB, Buffer, rows_that_fit
from deepinfer_backends.ascend950.emulate.apply_rope import GATHER_SCRATCH, rope_buffers
from deepinfer_backends.ascend950.emulate.plan import run_row_tiles
from deepinfer_backends.ascend950.emulate.rms_norm import rms_norm

SCALE_BLOCK = {"fp8": 32, "fp4": 16, "index_fp4": 32}
"""Values per scale in each quantized cache format."""


def plan_buffers(rows: int, dim: int, rope_dim: int, element: int, fmt: str) -> tuple[Buffer, ...]:
    """A vector core's UB buffers for tiles of ``rows`` rows in cache format ``fmt``, in layout
    order: the input rows (double-buffered; the keys, then what a reader of the cache sees, are
    rounded into the same slot), the float32 working tile, the squares tile (then the block
    magnitudes; for ``fp8`` the quantized values in its first ``rows * dim`` bytes and each row's
    scale bytes at row ``rows + r`` of its ``[4 * rows, dim]`` byte view; for the FP4 formats the
    rounding's steps, then the packed codes in half precision, then the decoded magnitudes), the
    float32 weight row, each row's norm scale, the tile's slots, for a quantized format each scale
    block's max (then its scale) and its scale's reciprocal, for the FP4 formats the codes (then
    the decoded values), the gather's offsets that pair them (the pairs land in the working tile)
    and the packed bytes (each row's scale bytes at row ``rows + r``, or for ``fp4`` from byte
    ``rows * dim / 2`` on), the rotation's buffers
    (:func:`~deepinfer_backends.ascend950.emulate.apply_rope.rope_buffers`); then the scratch the
    lowering takes for the row reductions and the gathers."""
    tile = rows * dim
    scales = (Buffer("block_max", "UB", tile // SCALE_BLOCK[fmt] * 4),
              Buffer("recip", "UB", tile // SCALE_BLOCK[fmt] * 4)) if fmt in SCALE_BLOCK else ()
    fp4 = (Buffer("codes", "UB", tile * 4), Buffer("pair_offsets", "UB", tile * 4),
           Buffer("packed", "UB", tile)) if fmt in ("fp4", "index_fp4") else ()
    return (Buffer("rows_in", "UB", tile * element, copies=2), Buffer("work", "UB", tile * 4),
            Buffer("squares", "UB", tile * 4), Buffer("weight", "UB", dim * 4), Buffer("scale", "UB", rows * 4),
            Buffer("slots", "UB", rows * 4), *scales, *fp4, *rope_buffers(rows, rope_dim),
            Buffer("reduce_scratch", "UB", tile * 2), Buffer("gather_scratch", "UB", GATHER_SCRATCH))


def row_tile(dim: int, rope_dim: int, element: int, fmt: str, platform: str = "A5") -> int:
    """Rows a vector core's UB tile holds: :func:`plan_buffers` in at most half the UB."""
    return rows_that_fit(lambda rows: plan_buffers(rows, dim, rope_dim, element, fmt), 128 * KIB, platform)


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
    tile = row_tile(spec.dim, cos_sin.shape[1], x.element_size(), fmt, platform)
    run_row_tiles(x.shape[0], tile, 2 * AI_CORES[platform], store)
    return out
