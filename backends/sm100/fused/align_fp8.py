"""FP8 rows with UE8M0 scales per 32 along K moved to one scale per 128, in one Triton pass over
the grouped GEMM's tiles, for the native FP8 grouped GEMM (``kernels/grouped_gemm_fp8_k128.py``):
the aligned rows, and their scales already gathered per tile as that kernel reads them.

Per row and 128 values the largest scale byte ``E`` is kept, and each block of 32 with byte ``s``
has its e4m3 values multiplied by ``2 ** (s - E)`` in float32 (exact) and rounded to e4m3, nearest
with ties to even. A shifted value of at least ``2 ** -6`` is still an e4m3 number; a smaller one
is rounded to e4m3's subnormal step ``2 ** -9`` by adding and subtracting ``1.5 * 2 ** 14``, which
float32 addition rounds to that step. Every conversion back to e4m3 is then exact, so the bytes
are those of :func:`~deepinfer_backends.sm100.fp8_scales.align_reference` whatever rounding
the conversion uses (Triton's interpreter truncates). A block with scale byte 0 reads as zeros;
NaN codes are not expected (the quantizer never writes them)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_backends.sm100.fp8_scales import BLOCK_M, GROUP

BLOCK = 32
"""Values under one input scale byte."""
SUBNORMAL_ROUNDER = 1.5 * 2.0 ** 14
"""A float32 whose spacing is e4m3's subnormal step ``2 ** -9``."""


@triton.jit
def align_fp8_kernel(x, x_scale, schedule, out, out_scale, k, tiles, TILE_ROWS: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, ROUNDER: tl.constexpr):
    """For tile ``t`` of ``schedule int32 [3, tiles]`` (expert, first row, end row) and the
    ``GROUP`` values at ``g``: rows ``[first, end)`` of ``x uint8 [m, k]`` (e4m3 codes) with
    ``x_scale uint8 [m, k / BLOCK]`` aligned into ``out uint8 [m, k]``, their scales (``2 ** (E -
    127)``) into ``out_scale float32 [k / GROUP, tiles * TILE_ROWS]`` at ``[g, TILE_ROWS t + i]``,
    1 in the tile's slots past its end (rows the GEMM never stores)."""
    BLOCKS: tl.constexpr = GROUP // BLOCK
    tile = tl.program_id(0)
    group = tl.program_id(1)
    slot = tl.arange(0, TILE_ROWS)
    rows = (tl.load(schedule + tiles + tile) + slot).to(tl.int64)
    live = rows < tl.load(schedule + 2 * tiles + tile)
    byte = tl.load(x_scale + rows[:, None] * (k // BLOCK) + group * BLOCKS + tl.arange(0, BLOCKS)[None, :],
                   mask=live[:, None], other=0).to(tl.int32)
    top = tl.max(byte, axis=1)
    drop = tl.minimum(top[:, None] - byte, 31)
    factor = tl.where(byte > 0, (127 - drop) << 23, 0).to(tl.float32, bitcast=True)
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (TILE_ROWS, BLOCKS, BLOCK)), (TILE_ROWS, GROUP))
    offsets = rows[:, None] * k + group * GROUP + tl.arange(0, GROUP)[None, :]
    code = tl.load(x + offsets, mask=live[:, None], other=0)
    shifted = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * factor
    rounded = (shifted + ROUNDER) - ROUNDER
    value = rounded.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | tl.where(factor > 0, code & 128, 0)
    tl.store(out + offsets, value, mask=live[:, None])
    scale = tl.where(top > 0, top << 23, 1 << 22).to(tl.float32, bitcast=True)
    tl.store(out_scale + group * (tiles * TILE_ROWS) + tile * TILE_ROWS + slot, tl.where(live, scale, 1.0))


def align_fp8(data: torch.Tensor, scale: torch.Tensor, schedule: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [m, k], float32 [k / 128, tiles * 128])`` of FP8 rows ``data e4m3 [m, k]`` with
    ``scale uint8 [m, k / 32]`` over the 128-row tiles of ``schedule int32 [3, tiles]``
    (:func:`~deepinfer_backends.sm100.gemm.shared_schedule`): the scales laid out as
    :func:`~deepinfer_backends.sm100.fp8_scales.tile_scales` lays them out; ``k`` a multiple of
    128. Rows outside every tile are left unwritten."""
    m, k = data.shape
    if k % GROUP or tuple(scale.shape) != (m, k // BLOCK) or scale.dtype != torch.uint8:
        raise ValueError(f"align_fp8 takes data [m, k] with k a multiple of {GROUP} and uint8 scale [m, k/{BLOCK}]; "
                         f"got data {tuple(data.shape)}, scale {scale.dtype} {tuple(scale.shape)}")
    tiles = schedule.shape[1]
    out = torch.empty(m, k, dtype=torch.uint8, device=data.device)
    out_scale = torch.empty(k // GROUP, tiles * BLOCK_M, dtype=torch.float32, device=data.device)
    if m and k and tiles:
        align_fp8_kernel[(tiles, k // GROUP)](
            data.contiguous().view(torch.uint8), scale.contiguous(), schedule.contiguous(), out, out_scale, k, tiles,
            TILE_ROWS=BLOCK_M, GROUP=GROUP, BLOCK=BLOCK, ROUNDER=SUBNORMAL_ROUNDER, num_warps=8)
    return out.view(torch.float8_e4m3fn), out_scale


def main() -> None:
    """Check the bytes and tile scales against :func:`~deepinfer_backends.sm100.fp8_scales.aligned`
    on this GPU: every non-NaN e4m3 code under random scale bytes (some 0), ragged segments."""
    from deepinfer.hal.formats import Quantized
    from deepinfer.hal.ops.grouped_gemm import tile_bounds
    from deepinfer_backends.sm100.fp8_scales import aligned, tile_scales

    gen = torch.Generator().manual_seed(0)
    for sizes, k in (([1], 128), ([0, 37, 130, 0, 5], 512), ([300, 1, 255, 444], 4096)):
        m = sum(sizes)
        codes = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
        scale = torch.randint(100, 140, (m, k // BLOCK), generator=gen, dtype=torch.uint8)
        scale[torch.rand(m, k // BLOCK, generator=gen) < 0.05] = 0
        q = Quantized(codes.view(torch.float8_e4m3fn).cuda(), scale.cuda(), "fp8", BLOCK)
        schedule = torch.stack(tile_bounds(torch.tensor(sizes).cuda(), m, BLOCK_M)).to(torch.int32)
        want, want_scale = aligned(q)
        got, got_scale = align_fp8(q.data, q.scale, schedule)
        same = (torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                and torch.equal(got_scale, tile_scales(want_scale, schedule)))
        print(f"align_fp8 sizes={sizes} k={k}: {'PASS' if same else 'FAIL'}")


if __name__ == "__main__":
    main()
