"""The grouped GEMMs' tile schedule in one Triton program: every tile's expert, first row and end
row from the segment sizes, on the device, with no host read (the same tiles as
:func:`deepinfer.hal.ops.grouped_gemm.tile_bounds`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 8192
"""Tiles x experts compared at once (the tile block shrinks as the expert count grows)."""


@triton.jit
def tile_schedule_kernel(sizes, out, experts, tiles, TILE_ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_T: tl.constexpr):
    """``out int32 [3, tiles]``: tile ``t`` belongs to the expert whose run of tiles holds it
    (``experts`` past the last run), starts ``TILE_ROWS`` rows apart within its segment and ends
    where the segment does. ``sizes``: int64 ``[experts]``, at most ``BLOCK_E``."""
    e = tl.arange(0, BLOCK_E)
    live = e < experts
    size = tl.load(sizes + e, mask=live, other=0).to(tl.int32)
    per = (size + TILE_ROWS - 1) // TILE_ROWS
    ends = tl.cumsum(size, 0)
    tile_ends = tl.cumsum(per, 0)
    starts = ends - size
    first_tiles = tile_ends - per
    for t0 in range(0, tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        expert = tl.sum(((tile_ends[None, :] <= t[:, None]) & live[None, :]).to(tl.int32), axis=1)
        pick = e[None, :] == tl.minimum(expert, experts - 1)[:, None]
        start = tl.sum(tl.where(pick, starts[None, :], 0), axis=1)
        end = tl.sum(tl.where(pick, ends[None, :], 0), axis=1)
        first_tile = tl.sum(tl.where(pick, first_tiles[None, :], 0), axis=1)
        inside = t < tiles
        tl.store(out + t, expert, mask=inside)
        tl.store(out + tiles + t, start + (t - first_tile) * TILE_ROWS, mask=inside)
        tl.store(out + 2 * tiles + t, end, mask=inside)


def tile_schedule(group_sizes: torch.Tensor, rows: int, tile_rows: int) -> torch.Tensor:
    """``int32 [3, ceil(rows / tile_rows) + experts]`` of :func:`tile_schedule_kernel` for int64
    ``group_sizes [experts]`` (``experts >= 1``) on the device, in one launch."""
    experts = group_sizes.shape[0]
    tiles = -(-rows // tile_rows) + experts
    out = torch.empty(3, tiles, dtype=torch.int32, device=group_sizes.device)
    block_e = max(16, triton.next_power_of_2(experts))
    block_t = min(256, max(16, TILE_ELEMENTS // block_e))
    tile_schedule_kernel[(1,)](group_sizes.contiguous(), out, experts, tiles, TILE_ROWS=tile_rows, BLOCK_E=block_e,
                               BLOCK_T=block_t, num_warps=4)
    return out


def main() -> None:
    """Check the schedule against :func:`~deepinfer.hal.ops.grouped_gemm.tile_bounds` on this GPU."""
    from deepinfer.hal.ops.grouped_gemm import tile_bounds

    gen = torch.Generator().manual_seed(0)
    for experts, rows_each, tile_rows in ((1, 7, 64), (16, 40, 64), (48, 300, 128), (384, 12, 64), (384, 0, 128)):
        sizes = torch.randint(0, 2 * rows_each + 1, (experts,), generator=gen)
        rows = int(sizes.sum())
        want = torch.stack(tile_bounds(sizes, rows, tile_rows)).to(torch.int32)
        got = tile_schedule(sizes.cuda(), rows, tile_rows).cpu()
        assert torch.equal(got, want), f"{experts} experts, {rows} rows, tiles of {tile_rows}: schedules differ"
        print(f"tile_schedule: {experts} experts, {rows} rows, tiles of {tile_rows}: ok")


if __name__ == "__main__":
    main()
