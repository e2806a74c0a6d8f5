"""Grouped bf16 GEMM over contiguous expert segments: ``y[seg e] = x[seg e] @ w[e].T``.

Rows of ``x`` come sorted by expert in contiguous segments (``group_sizes``). The grid walks a
tile schedule: tile ``t`` covers ``block_m`` rows of one expert (the last tile of a segment is
partial), so the kernel compiles once per ``(experts, n, k)`` whatever the routing split. Tiles
past the last segment (the schedule has a fixed upper bound, ``ceil(m / block_m) + experts``,
so building it needs no host sync) exit at once. Rows past a segment's end are read (they
belong to the next expert or lie past ``m``) but never written."""

import tilelang
import tilelang.language as T
import torch

from deepinfer.hal.ops.grouped_gemm import tile_bounds


@tilelang.jit
def grouped_gemm_bf16(experts: int, n: int, k: int, block_m: int = 128, block_n: int = 256, block_k: int = 64,
                      num_stages: int = 3, threads: int = 256, swizzle: int = 8, out_dtype: str = "bfloat16"):
    """Kernel ``(x [m, k], w [experts, n, k], tile_expert, tile_row, tile_end [tiles], y [m, n])``;
    ``m`` and ``tiles`` are dynamic. ``tile_expert[t] >= experts`` marks an empty tile. ``y`` is
    ``out_dtype`` (``"float32"``: the accumulator unrounded)."""
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    dtype, accum = "bfloat16", "float"

    @T.prim_func
    def kernel(x: T.Tensor((m, k), dtype), w: T.Tensor((experts, n, k), dtype),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), out_dtype)):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=threads) as (bn, bt):
            x_tile = T.alloc_shared((block_m, block_k), dtype)
            w_tile = T.alloc_shared((block_n, block_k), dtype)
            acc = T.alloc_fragment((block_m, block_n), accum)
            T.use_swizzle(panel_size=swizzle)  # runs panels of `swizzle` tiles across n: each weight tile read once
            if tile_expert[bt] < experts:
                T.clear(acc)
                for kb in T.Pipelined(T.ceildiv(k, block_k), num_stages=num_stages):
                    T.copy(x[tile_row[bt]:tile_row[bt] + block_m, kb * block_k:(kb + 1) * block_k], x_tile)
                    T.copy(w[tile_expert[bt], bn * block_n:(bn + 1) * block_n, kb * block_k:(kb + 1) * block_k],
                           w_tile)
                    T.gemm(x_tile, w_tile, acc, transpose_B=True)
                for i, j in T.Parallel(block_m, block_n):
                    if i < tile_end[bt] - tile_row[bt]:
                        y[tile_row[bt] + i, bn * block_n + j] = T.cast(acc[i, j], out_dtype)

    return kernel


def tile_schedule(group_sizes: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """``int32 [3, ceil(rows / block_m) + experts]``: each tile's expert, first row and end row
    (exclusive), computed on ``group_sizes``' device without a host sync
    (:func:`~deepinfer.hal.ops.grouped_gemm.tile_bounds`); one Triton launch where the sizes are
    on the GPU (:mod:`..fused.tile_schedule`). Unused tiles get expert ``experts`` (which the
    kernel skips)."""
    from deepinfer_backends.sm100.launch import on_device

    if on_device(group_sizes) and group_sizes.shape[0]:
        from deepinfer_backends.sm100.fused.tile_schedule import tile_schedule as on_gpu

        return on_gpu(group_sizes.to(torch.int64), rows, block_m)
    return torch.stack(tile_bounds(group_sizes, rows, block_m)).to(torch.int32)


def reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """float32-accumulated torch result, in bf16."""
    out, start = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device), 0
    for expert, size in enumerate(group_sizes.tolist()):
        out[start:start + size] = (x[start:start + size].float() @ w[expert].float().T).to(x.dtype)
        start += size
    return out


def run(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, **tiles) -> torch.Tensor:
    """Compile (cached by shape) and launch on ``x``'s device."""
    block_m = tiles.get("block_m", 128)
    schedule = tile_schedule(group_sizes, x.shape[0], block_m)
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        kernel = grouped_gemm_bf16(w.shape[0], w.shape[1], w.shape[2], **tiles)
        kernel(x, w, schedule[0], schedule[1], schedule[2], y)
    return y


def main(experts: int = 8, n: int = 4096, k: int = 4096, rows_per_expert: int = 512) -> None:
    """Check against torch and time on the current GPU."""
    from tilelang.profiler import do_bench

    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(rows_per_expert // 2, rows_per_expert * 3 // 2, (experts,), generator=gen)
    x = torch.randn(int(sizes.sum()), k, generator=gen).to("cuda", torch.bfloat16)
    w = (k ** -0.5 * torch.randn(experts, n, k, generator=gen)).to("cuda", torch.bfloat16)
    sizes = sizes.cuda()
    torch.testing.assert_close(run(x, w, sizes), reference(x, w, sizes), atol=2e-2, rtol=2e-2)
    ms = do_bench(lambda: run(x, w, sizes))
    print(f"grouped_gemm_bf16 m={x.shape[0]} n={n} k={k} experts={experts}: {ms:.3f} ms, "
          f"{2 * x.shape[0] * n * k / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
