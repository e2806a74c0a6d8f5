"""Emulated ascend950 RoPE: token rows spread over the vector cores in UB tiles; each tile's
trailing ``R`` dims turn in float32 by its tokens' angles (interleaved pairs, conjugate to undo)
and are rounded once to the rows' dtype."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.rope import apply_rope as reference_rope
from deepinfer.hal.ops.rope import check_rope_args
from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate.plan import BlockPlan, WriteRecord
from deepinfer_backends.ascend950.emulate.rms_norm import row_tile


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, conjugate: bool = False,
               out: torch.Tensor | None = None, platform: str = "A5") -> torch.Tensor:
    """:func:`deepinfer.hal.ops.rope.apply_rope` as the ascend950 kernel plans it: the rows are
    each token's heads (``x [T, ..., D]`` viewed as ``[T * heads, D]``), so a tile never holds more
    than the UB takes whatever the head count."""
    check_rope_args(x, positions, cos_sin, out)
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    heads = flat.shape[0] // max(x.shape[0], 1)
    rows = row_tile(dim, x.element_size(), platform)
    result = torch.empty_like(flat)
    record = WriteRecord(flat.shape[0], 1)
    plan = BlockPlan(2 * AI_CORES[platform])
    for r0 in range(0, flat.shape[0], rows):
        plan.add((r0, min(r0 + rows, flat.shape[0])))
    for core_tiles in plan.per_core():
        for r0, r1 in core_tiles:
            tokens = torch.arange(r0, r1, device=positions.device) // heads
            result[r0:r1] = reference_rope(flat[r0:r1], positions[tokens], cos_sin, conjugate)
            record.store(slice(r0, r1), slice(0, 1))
    record.check(flat.shape[0])
    result = result.view(x.shape)
    return result if out is None else out.copy_(result)
