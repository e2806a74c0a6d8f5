"""The native FP8 grouped GEMM of :mod:`..grouped_gemm_fp8_k128` on persistent CTAs: ``ctas`` CTAs
(one an SM) each walk the output blocks ``cta, cta + ctas, ...`` in the panel order the served
kernel's ``T.use_swizzle`` gives, with one TMA ring across their blocks. The producer streams the
next block's k-blocks while the consumers promote the last k-block and store the block, so that
at short reductions (w2, K 2048: 16 k-blocks a block) a block's first loads and the store of the
one before no longer wait on each other. Same operands, tile schedule, promotion and result as the
served kernel; its ``run`` and ``reference`` take the same arguments.

Not served and not yet run on hardware: it compiles for sm_90a (168 registers, no spill, like the
served kernel); :func:`main` checks it against the float64 reference on a GPU and times it beside
the served kernel and ``torch._scaled_mm``."""
import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.fp8_scales import BLOCK_M, GROUP, tile_scales
from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule
from deepinfer_backends.sm100.kernels.grouped_gemm_fp8_k128 import (_PASS_CONFIGS, CONSUMERS, E4M3, SHARED_BYTES,
                                                                    reference)

MODULE = "experimental.grouped_gemm_fp8_k128_persistent"
__all__ = ["grouped_gemm_fp8_k128_persistent", "reference", "run", "main"]


def _raster(block, columns, rows, panel):
    """``(column, row)`` of linear block ``block`` on a ``columns x rows`` grid walked in panels of
    ``panel`` rows, column by column, every other panel backwards (``T.use_swizzle``'s order)."""
    span = panel * columns
    index, offset = block // span, block % span
    last = T.ceildiv(columns * rows, span) - 1
    height = T.if_then_else(index < last, panel, (columns * rows - index * span) // columns)
    column = T.if_then_else(index % 2 == 1, columns - 1 - offset // height, offset // height)
    return column, offset % height + index * panel


@T.macro
def _locate(at, block, columns, tiles, panel, tile_expert, tile_row, tile_end):
    """``at[:5]``: block ``block``'s column, tile, expert, first row and rows."""
    column, tile = _raster(block, columns, tiles, panel)
    at[0] = column
    at[1] = tile
    at[2] = tile_expert[tile]
    at[3] = tile_row[tile]
    at[4] = tile_end[tile] - tile_row[tile]


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_fp8_k128_persistent(experts: int, n: int, k: int, block_n: int = 192, num_stages: int | None = None,
                                     stagger: bool = True, swizzle: int = 8, ctas: int = 132):
    """The served kernel's signature and contract on ``ctas`` persistent CTAs (an H100's or H200's
    SM count by default)."""
    if k <= 0 or k % GROUP or block_n % 16 or ctas <= 0:
        raise ValueError(f"k={k} must be a positive multiple of {GROUP}, block_n={block_n} a multiple of 16, "
                         f"ctas={ctas} positive")
    num_stages = num_stages or min(8, (SHARED_BYTES - 1024) // ((BLOCK_M + block_n) * GROUP + BLOCK_M * 4))
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    groups = k // GROUP
    columns = T.ceildiv(n, block_n)

    @T.prim_func
    def kernel(x: T.Tensor((m, k), E4M3), x_scale: T.Tensor((groups, tiles * BLOCK_M), "float"),
               w: T.Tensor((experts, n, k), E4M3), w_scale: T.Tensor((experts, n), "float"),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), "float")):
        with T.Kernel(ctas, threads=CONSUMERS + 128) as cta:
            x_s = T.alloc_shared((num_stages, BLOCK_M, GROUP), E4M3)
            w_s = T.alloc_shared((num_stages, block_n, GROUP), E4M3)
            xs_s = T.alloc_shared((num_stages, BLOCK_M), "float")
            part = T.alloc_fragment((BLOCK_M, block_n), "float")
            acc = T.alloc_fragment((BLOCK_M, block_n), "float")
            full = T.alloc_barrier([1] * num_stages)
            empty = T.alloc_barrier([CONSUMERS] * num_stages)
            turn = T.alloc_barrier([128])  # the first warpgroup's first k-block is promoted
            live = T.alloc_local((1,), "int32")
            done = T.alloc_local((1,), "int32")  # blocks this CTA has run: the ring's position
            at = T.alloc_local((5,), "int32")  # this block's column, tile, expert, first row, rows
            tx = T.get_thread_binding()
            done[0] = 0
            if tx >= CONSUMERS:  # producer
                T.set_max_nreg(40, 0)
                for r in T.serial(T.ceildiv(columns * tiles - cta, ctas)):
                    _locate(at, r * ctas + cta, columns, tiles, swizzle, tile_expert, tile_row, tile_end)
                    bn, bt, expert, row0 = at[0], at[1], at[2], at[3]
                    if expert < experts:
                        for kb in T.serial(groups):
                            slot = (done[0] * groups + kb) % num_stages
                            T.barrier_wait(empty[slot], (((done[0] * groups + kb) // num_stages) & 1) ^ 1)
                            T.tma_copy(x[row0:row0 + BLOCK_M, kb * GROUP:(kb + 1) * GROUP], x_s[slot, :, :],
                                       barrier=full[slot])
                            T.tma_copy(x_scale[kb, bt * BLOCK_M:(bt + 1) * BLOCK_M], xs_s[slot, :], barrier=full[slot])
                            T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * GROUP:(kb + 1) * GROUP],
                                       w_s[slot, :, :], barrier=full[slot], annotations={"emit_arrive": 1})
                        done[0] += 1
            else:  # consumers
                T.set_max_nreg(232, 1)
                for r in T.serial(T.ceildiv(columns * tiles - cta, ctas)):
                    _locate(at, r * ctas + cta, columns, tiles, swizzle, tile_expert, tile_row, tile_end)
                    bn, expert, row0, rows = at[0], at[2], at[3], at[4]
                    if expert < experts:
                        live[0] = T.if_then_else((tx // 128) * 64 < rows, 1, 0)
                        T.clear(acc)
                        if stagger:
                            if done[0] == 0:
                                if tx >= 128:
                                    T.barrier_wait(turn[0], 0)
                        for kb in T.serial(groups):
                            slot = (done[0] * groups + kb) % num_stages
                            T.barrier_wait(full[slot], ((done[0] * groups + kb) // num_stages) & 1)
                            if live[0]:
                                T.wgmma_gemm(x_s[slot, :, :], w_s[slot, :, :], part, transpose_B=True,
                                             policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                                T.wait_wgmma(0)
                                for i, j in T.Parallel(BLOCK_M, block_n):
                                    acc[i, j] += part[i, j] * xs_s[slot, i]
                            if stagger:
                                if done[0] == 0:
                                    if kb == 0:
                                        if tx < 128:
                                            T.barrier_arrive(turn[0])
                            T.barrier_arrive(empty[slot])
                        for i, j in T.Parallel(BLOCK_M, block_n):
                            if i < rows and bn * block_n + j < n:
                                y[row0 + i, bn * block_n + j] = acc[i, j] * w_scale[expert, bn * block_n + j]
                        done[0] += 1

    return kernel


def run(x, x_scale, w, w_scale, group_sizes, **tiles) -> torch.Tensor:
    """Compile (cached by shape and tiles) and launch on ``x``'s device, one CTA an SM unless
    ``ctas`` is given; the served kernel's ``run`` arguments."""
    from deepinfer_backends.sm100.launch import compiled

    tiles.setdefault("ctas", torch.cuda.get_device_properties(x.device).multi_processor_count)
    schedule = tile_schedule(group_sizes, x.shape[0], BLOCK_M)
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        compiled(MODULE, "grouped_gemm_fp8_k128_persistent", *w.shape, **tiles)(
            x, tile_scales(x_scale, schedule), w, w_scale, *schedule, y)
    return y


SHAPES = (("w2, 48 experts x 1024 rows", 48, 1024, 4096, 2048), ("w2, 48 experts x 256 rows", 48, 256, 4096, 2048),
          ("w13, 48 experts x 1024 rows", 48, 1024, 4096, 4096))
"""(label, experts, rows an expert, n, k) that :func:`main` times; two segments are moved by 37
rows so that partial tiles occur."""


def main() -> None:
    """Check against the float64 :func:`reference` (relative to the largest ``|y|``) and time this
    kernel and the served one, as their ``run`` launches them, beside ``torch._scaled_mm`` on 8192^3."""
    from tilelang.profiler import do_bench

    from deepinfer_backends.sm100.kernels import grouped_gemm_fp8_k128 as served

    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    dense = 2 * 8192 ** 3 / do_bench(lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16)) / 1e9
    print(f"torch._scaled_mm e4m3 8192^3: {dense:.0f} TFLOP/s")
    gen = torch.Generator("cuda").manual_seed(0)
    kernels = (("served", served.run, {"block_n": 192}), ("persistent", run, {"block_n": 192}),
               ("persistent", run, {"block_n": 208}))
    for label, experts, rows, n, k in SHAPES:
        sizes = torch.full((experts,), rows, dtype=torch.int64, device="cuda")
        sizes[1] += 37
        sizes[5] -= 37
        x = torch.randn(int(sizes.sum()), k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn(experts, n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        x_scale = torch.exp2(torch.randint(-8, 0, (x.shape[0], k // GROUP), device="cuda", generator=gen).float())
        w_scale = torch.exp2(torch.randint(-8, 0, (experts, n), device="cuda", generator=gen).float())
        want = reference(x, x_scale, w, w_scale, sizes)
        for name, launch, tiles in kernels:
            error = ((launch(x, x_scale, w, w_scale, sizes, **tiles) - want).abs().max() / want.abs().max()).item()
            ms = do_bench(lambda: launch(x, x_scale, w, w_scale, sizes, **tiles))
            rate = 2 * x.shape[0] * n * k / ms / 1e9
            print(f"{label}, {name} {tiles}: {ms:.3f} ms {rate:.0f} TFLOP/s {rate / dense:.3f} of _scaled_mm, "
                  f"error {error:.1e} {'PASS' if error < 1e-3 else 'FAIL'}", flush=True)


if __name__ == "__main__":
    main()
