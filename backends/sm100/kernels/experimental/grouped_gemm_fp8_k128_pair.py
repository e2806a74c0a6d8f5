"""The native FP8 grouped GEMM (:mod:`..grouped_gemm_fp8_k128`) on 2-CTA clusters that share the
weight tile: the served kernel's operands, contract, k-block promotion and warp roles, with two
adjacent row tiles at one column block forming a cluster. Where both tiles are the same
expert's, rank 0 multicasts each k-block's weight tile (24 KiB at 192 columns) into both CTAs'
rings, so the pair reads it from L2 once instead of twice: 56 KiB a k-block for the pair
instead of 80. A pair whose tiles belong to different experts (or whose second tile is past the
schedule) loads as the served kernel does.

A stage may only be refilled once both CTAs have read it, so each consumer warp arrives on the
``empty`` barrier of both CTAs (one lane each, after ``__syncwarp``); a pair that does not share
arrives twice on its own. Both CTAs wait on a cluster barrier before exiting, so that no remote
arrival lands in a CTA that has left. The grid runs row tiles along x (clusters pair them) and
column blocks along y, in panels of ``swizzle`` row tiles walked down the columns, the block
order of the served kernel.

Not run on hardware yet; ``main()`` checks it against float64 on ragged segments and times it
beside the served kernel and ``torch._scaled_mm``."""
import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.fp8_scales import BLOCK_M, GROUP, tile_scales
from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule
from deepinfer_backends.sm100.kernels.grouped_gemm_fp8_k128 import (_PASS_CONFIGS, CONSUMERS, E4M3, SHARED_BYTES,
                                                                   reference)

MODULE = "experimental.grouped_gemm_fp8_k128_pair"


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_fp8_k128_pair(experts: int, n: int, k: int, block_n: int = 192, num_stages: int | None = None,
                               stagger: bool = True, swizzle: int = 8):
    """The served kernel's signature (:func:`..grouped_gemm_fp8_k128.grouped_gemm_fp8_k128`) on
    2-CTA clusters; ``swizzle`` even."""
    if k <= 0 or k % GROUP or block_n % 16 or swizzle % 2:
        raise ValueError(f"k={k} must be a positive multiple of {GROUP}, block_n={block_n} a multiple of 16, "
                         f"swizzle={swizzle} even")
    num_stages = num_stages or min(8, (SHARED_BYTES - 1024) // ((BLOCK_M + block_n) * GROUP + BLOCK_M * 4))
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    groups = k // GROUP
    warps = CONSUMERS // 32

    @T.prim_func
    def kernel(x: T.Tensor((m, k), E4M3), x_scale: T.Tensor((groups, tiles * BLOCK_M), "float"),
               w: T.Tensor((experts, n, k), E4M3), w_scale: T.Tensor((experts, n), "float"),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), "float")):
        with T.Kernel(T.ceildiv(tiles, 2) * 2, T.ceildiv(n, block_n), threads=CONSUMERS + 128,
                      cluster_dims=(2, 1, 1)) as (bt, bn):
            x_s = T.alloc_shared((num_stages, BLOCK_M, GROUP), E4M3)
            w_s = T.alloc_shared((num_stages, block_n, GROUP), E4M3)
            xs_s = T.alloc_shared((num_stages, BLOCK_M), "float")
            part = T.alloc_fragment((BLOCK_M, block_n), "float")
            acc = T.alloc_fragment((BLOCK_M, block_n), "float")
            full = T.alloc_barrier([1] * num_stages)
            empty = T.alloc_cluster_barrier([warps * 2] * num_stages)
            turn = T.alloc_barrier([128])  # the first warpgroup's first k-block is promoted
            live = T.alloc_local((1,), "int32")  # this warpgroup's rows hold some of the tile's rows
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle, order="column")
            rank = bt % 2
            first = bt - rank
            tile = T.min(bt, tiles - 1)
            expert = T.if_then_else(bt < tiles, tile_expert[tile], experts)
            row0, rows = tile_row[tile], tile_end[tile] - tile_row[tile]
            shared = T.if_then_else(first + 1 < tiles and tile_expert[first] == tile_expert[T.min(first + 1, tiles - 1)]
                                    and tile_expert[first] < experts, 1, 0)
            if expert < experts:
                if tx >= CONSUMERS:  # producer
                    T.set_max_nreg(40, 0)
                    for kb in T.serial(groups):
                        slot = kb % num_stages
                        T.barrier_wait(empty[slot], ((kb // num_stages) & 1) ^ 1)
                        T.tma_copy(x[row0:row0 + BLOCK_M, kb * GROUP:(kb + 1) * GROUP], x_s[slot, :, :],
                                   barrier=full[slot])
                        T.tma_copy(x_scale[kb, tile * BLOCK_M:(tile + 1) * BLOCK_M], xs_s[slot, :], barrier=full[slot])
                        if shared == 1:
                            T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * GROUP:(kb + 1) * GROUP],
                                       w_s[slot, :, :], barrier=full[slot], cluster_mask=3,
                                       annotations={"emit_arrive": 1})
                        else:
                            T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * GROUP:(kb + 1) * GROUP],
                                       w_s[slot, :, :], barrier=full[slot], annotations={"emit_arrive": 1})
                else:  # consumers
                    T.set_max_nreg(232, 1)
                    live[0] = T.if_then_else((tx // 128) * 64 < rows, 1, 0)
                    T.clear(acc)
                    if stagger:
                        if tx >= 128:
                            T.barrier_wait(turn[0], 0)
                    for kb in T.serial(groups):
                        slot = kb % num_stages
                        T.barrier_wait(full[slot], (kb // num_stages) & 1)
                        if live[0]:
                            T.wgmma_gemm(x_s[slot, :, :], w_s[slot, :, :], part, transpose_B=True,
                                         policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                            T.wait_wgmma(0)
                            for i, j in T.Parallel(BLOCK_M, block_n):
                                acc[i, j] += part[i, j] * xs_s[slot, i]
                        if stagger:
                            if kb == 0:
                                if tx < 128:
                                    T.barrier_arrive(turn[0])
                        T.sync_warp()
                        if tx % 32 < 2:
                            T.mbarrier_arrive(empty[slot], T.if_then_else(shared == 1, tx % 32, rank))
                    for i, j in T.Parallel(BLOCK_M, block_n):
                        if i < rows and bn * block_n + j < n:
                            y[row0 + i, bn * block_n + j] = acc[i, j] * w_scale[expert, bn * block_n + j]
            T.cluster_sync()

    return kernel


def run(x, x_scale, w, w_scale, group_sizes, **tiles) -> torch.Tensor:
    """Compile (cached by shape and tiles) and launch on ``x``'s device, as the served kernel's
    :func:`..grouped_gemm_fp8_k128.run`."""
    from deepinfer_backends.sm100.launch import compiled

    schedule = tile_schedule(group_sizes, x.shape[0], BLOCK_M)
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        compiled(MODULE, "grouped_gemm_fp8_k128_pair", *w.shape, **tiles)(x, tile_scales(x_scale, schedule), w,
                                                                          w_scale, *schedule, y)
    return y


def _operands(sizes, n, k, generator, device="cuda"):
    x = torch.randn(int(sizes.sum()), k, generator=generator).to(torch.float8_e4m3fn)
    w = torch.randn(len(sizes), n, k, generator=generator).to(torch.float8_e4m3fn)
    x_scale = torch.exp2(torch.randint(-6, 2, (x.shape[0], k // GROUP), generator=generator).float())
    w_scale = torch.exp2(torch.randint(-6, 2, (len(sizes), n), generator=generator).float())
    return [t.to(device) for t in (x, x_scale, w, w_scale, sizes)]


def main() -> None:
    """Check against the float64 reference on ragged segments (odd tile counts, pairs that straddle
    experts, an odd number of column blocks) and time the pair beside the served kernel (same
    tiles) and ``torch._scaled_mm`` e4m3 8192^3 on compute-bound w2 and w13 shapes."""
    from tilelang.profiler import do_bench

    from deepinfer_backends.sm100.grouped_gemm_native import native_tiles
    from deepinfer_backends.sm100.kernels import grouped_gemm_fp8_k128 as served

    generator = torch.Generator().manual_seed(2)
    for n, k in ((384, 640), (576, 640)):
        args = _operands(torch.tensor([0, 130, 1, 255, 64, 0, 300]), n, k, generator)
        want = reference(*args)
        error = ((run(*args) - want).abs().max() / want.abs().max()).item()
        print(f"ragged segments n={n} k={k}: error {error:.1e} {'PASS' if error <= 2 ** -10 else 'FAIL'}", flush=True)
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    dense = 2 * 8192 ** 3 / do_bench(lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16)) / 1e9
    print(f"torch._scaled_mm e4m3 8192^3: {dense:.0f} TFLOP/s", flush=True)
    for label, experts, rows, n, k in (("w2, 48 x 1024 rows", 48, 1024, 4096, 2048),
                                       ("w2, 48 x 256 rows", 48, 256, 4096, 2048),
                                       ("w13, 48 x 1024 rows", 48, 1024, 4096, 4096)):
        sizes = torch.full((experts,), rows)
        sizes[1] += 37  # partial tiles, and pairs that straddle two experts
        sizes[5] -= 37
        args = _operands(sizes, n, k, generator)
        tiles = native_tiles(k)
        want = reference(*args) if k == 2048 and rows == 1024 else None
        for name, launch in (("served", served.run), ("pair", run)):
            got = launch(*args, **tiles)
            error = float("nan") if want is None else ((got - want).abs().max() / want.abs().max()).item()
            ms = do_bench(lambda: launch(*args, **tiles))
            rate = 2 * int(sizes.sum()) * n * k / ms / 1e9
            print(f"{label} {tiles} {name}: {ms:.3f} ms {rate:.0f} TFLOP/s {rate / dense:.3f} of _scaled_mm, "
                  f"error {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
