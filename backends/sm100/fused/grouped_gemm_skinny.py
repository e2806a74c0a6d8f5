"""The bf16 grouped GEMM for few rows per expert in one Triton kernel: each program takes one
tile of at most ``BLOCK_T`` rows of one expert (from the device tile schedule, or for few experts
worked out from the segment sizes by each program) and ``BLOCK_N``
of its output columns, and streams that slice of the expert's weight through shared memory in
``BLOCK_K`` steps, float32 accumulation, a bf16 store. The gated variant streams the gate and up
weights side by side and stores their SwiGLU (``grouped_swiglu``).

With a handful of rows an expert (decode) the GEMM reads each routed expert's weight once and
is bound by memory: many narrow column blocks keep every SM streaming, where the tensor-core
kernels' 64-row tiles leave most SMs idle. The tiles depend on the shapes and on the row count
(the tile schedule), so the kernel serves the default mode, not the batch-invariant one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_backends.sm100.fused.swiglu import clamped_swiglu

BLOCK_T = 16
BLOCK_K = 128
NUM_STAGES = 4
SCHEDULE_IN_KERNEL = 64
"""Most experts for which each program works out its own tile from the segment sizes (a cumulative
sum over the experts per program) instead of reading a schedule made by another launch."""
TARGET_PROGRAMS = 2 * 132
"""Working programs aimed at (two per SM of an H200): the column block narrows until the tiles
that can hold rows (one an expert, at most one a row) fill that many."""


@triton.jit
def grouped_gemm_skinny_kernel(x, w, w_up, y, schedule, tiles, experts, n, k, limit,
                               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               NUM_STAGES: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr,
                               BLOCK_E: tl.constexpr = 0):
    """Tile ``pid1`` of ``schedule int32 [3, tiles]`` (expert, first row, end row; expert
    ``experts`` marks an unused tile), or with ``BLOCK_E`` (a power of two, at least ``experts``)
    of the same schedule worked out here from ``schedule`` read as the int64 segment sizes
    ``[experts]``; columns ``[BLOCK_N * pid0, BLOCK_N * (pid0 + 1))``:
    ``y[rows, cols] = x[rows] @ w[expert, cols].T`` for ``x [M, k]``, ``w [experts, n, k]``.
    With ``GATED``, ``y = swiglu(gate, up)`` of the products with ``w`` (gate) and ``w_up`` (up),
    each rounded to ``x``'s dtype first, as a grouped GEMM would store it (``min(gate, limit)`` and
    ``clamp(up, -limit, limit)`` with ``CLAMP``; float32 math)."""
    tile = tl.program_id(1)
    if BLOCK_E:
        e = tl.arange(0, BLOCK_E)
        size = tl.load(schedule + e, mask=e < experts, other=0).to(tl.int32)
        per = (size + BLOCK_T - 1) // BLOCK_T
        ends = tl.cumsum(size, 0)
        tile_ends = tl.cumsum(per, 0)
        expert = tl.sum((tile_ends <= tile).to(tl.int32) * (e < experts).to(tl.int32))
        pick = e == expert
        end = tl.sum(tl.where(pick, ends, 0))
        first = end - tl.sum(tl.where(pick, size, 0)) + (tile - tl.sum(tl.where(pick, tile_ends - per, 0))) * BLOCK_T
    else:
        expert = tl.load(schedule + tile)
        first = tl.load(schedule + tiles + tile)
        end = tl.load(schedule + 2 * tiles + tile)
    if expert < experts:
        row = first + tl.arange(0, BLOCK_T)
        live = row < end
        col = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = col < n
        depth = tl.arange(0, BLOCK_K)
        x_rows = x + row[:, None].to(tl.int64) * k
        w_offsets = (expert.to(tl.int64) * n + col[:, None]) * k
        acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        up = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        for start in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
            kk = start + depth
            within = kk < k
            a = tl.load(x_rows + kk[None, :], mask=live[:, None] & within[None, :], other=0.0)
            b = tl.load(w + w_offsets + kk[None, :], mask=inside[:, None] & within[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            if GATED:
                c = tl.load(w_up + w_offsets + kk[None, :], mask=inside[:, None] & within[None, :], other=0.0)
                up = tl.dot(a, tl.trans(c), up)
        if GATED:
            acc = clamped_swiglu(acc.to(x.dtype.element_ty).to(tl.float32), up.to(x.dtype.element_ty).to(tl.float32),
                                 limit, CLAMP)
        tl.store(y + row[:, None].to(tl.int64) * n + col[None, :], acc.to(y.dtype.element_ty),
                 mask=live[:, None] & inside[None, :])


def block_n(rows: int, experts: int, n: int) -> int:
    """The column block: 64, halved (down to 16) while the tiles that can hold rows times the
    column blocks stay below :data:`TARGET_PROGRAMS`."""
    width = 64
    while width > 16 and min(rows, experts) * -(-n // width) < TARGET_PROGRAMS:
        width //= 2
    return width


def grouped_gemm_skinny(x: torch.Tensor, weight: torch.Tensor, schedule: torch.Tensor, y: torch.Tensor,
                        up: torch.Tensor | None = None, limit: float | None = None) -> None:
    """Launch :func:`grouped_gemm_skinny_kernel` into ``y [M, n]`` for contiguous bf16 ``x [M, k]``,
    ``weight [experts, n, k]`` and a tile schedule of :data:`BLOCK_T` rows, or the int64 segment
    sizes ``[experts]`` (at most :data:`SCHEDULE_IN_KERNEL` experts: each program works out its
    tile, with no schedule launch); with ``up`` (a weight like ``weight``) ``y`` is the SwiGLU of
    the two products (``limit``: its clamp, None for none)."""
    experts, n, k = weight.shape
    in_kernel = schedule.dim() == 1
    if in_kernel and not 0 < experts <= SCHEDULE_IN_KERNEL:
        raise ValueError(f"segment sizes serve up to {SCHEDULE_IN_KERNEL} experts, got {experts}; pass a schedule")
    tiles = -(-x.shape[0] // BLOCK_T) + experts if in_kernel else schedule.shape[1]
    width = block_n(x.shape[0], experts, n)
    grouped_gemm_skinny_kernel[(-(-n // width), tiles)](
        x, weight, weight if up is None else up, y, schedule, tiles, experts, n, k, float(limit or 0.0),
        BLOCK_T=BLOCK_T, BLOCK_N=width, BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, GATED=up is not None,
        CLAMP=limit is not None, BLOCK_E=max(16, triton.next_power_of_2(experts)) if in_kernel else 0, num_warps=4)


def main() -> None:
    """Check the kernel against the float64 grouped product, and its SwiGLU variant against the
    reference op, on this GPU."""
    from deepinfer_backends.sm100.fused.tile_schedule import tile_schedule

    gen = torch.Generator().manual_seed(0)
    for experts, n, k, rows in ((16, 2048, 4096, 6), (16, 4096, 2048, 96), (8, 200, 72, 13), (1, 512, 256, 3)):
        sizes = torch.multinomial(torch.ones(experts), rows, replacement=True, generator=gen).bincount(
            minlength=experts)
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        w = (torch.randn(experts, n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
        want = torch.cat([x[s:e].double() @ w[i].double().T for i, (s, e) in
                          enumerate(zip(sizes.cumsum(0) - sizes, sizes.cumsum(0)))])
        y = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        grouped_gemm_skinny(x.cuda(), w.cuda(), tile_schedule(sizes.cuda(), rows, BLOCK_T), y)
        error = (y.cpu().double() - want).abs().max().item()
        assert error <= 2 ** -7 * want.abs().max().item(), f"{experts} experts, {n}x{k}, {rows} rows: error {error}"
        print(f"grouped_gemm_skinny: {experts} experts, {n}x{k}, {rows} rows: max error {error:.2e}: ok")
    from deepinfer_backends.sm100.selfcheck import run

    run("grouped_swiglu")


if __name__ == "__main__":
    main()
