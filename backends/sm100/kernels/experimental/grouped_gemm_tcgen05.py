"""Grouped bf16 GEMM over contiguous expert segments on Blackwell's tcgen05 tensor cores (sm_100a).

The same kernel signature, tile schedule (:func:`grouped_gemm.tile_schedule`) and result as
:func:`grouped_gemm.grouped_gemm_bf16`; what changes is where the product is made. The
``block_m x block_n`` float32 accumulator lives in tensor memory (TMEM, ``block_n`` or fewer of
its 512 columns) and ``tcgen05.mma`` writes it from shared memory, so no register holds it
during the K loop. The CTA is warp-specialised: warp 0 streams the ``x`` and ``w`` tiles by TMA
into a ring of ``num_stages`` shared buffers (``loaded`` barriers), warp 1 issues one MMA per K
block and frees each buffer when that MMA completes (``consumed`` barriers, ``tcgen05.commit``),
then signals ``done``; every warp then reads its TMEM lanes into registers and stores the rows
of the tile's segment. TMA zero-fills rows past ``m`` and columns past ``n`` or ``k``.

Compiled for sm_100a but not run on Blackwell hardware. Hence the wrappers select it
only with ``backend.options.tcgen05=true`` on an sm_100a device (``toolchain.kernel_module``), and
``tests/backends/test_sm100_tcgen05.py`` only checks that it lowers to tcgen05/TMEM code that
nvcc and ptxas accept."""

import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.kernels.grouped_gemm import reference, tile_schedule


@tilelang.jit
def grouped_gemm_bf16(experts: int, n: int, k: int, block_m: int = 128, block_n: int = 256, block_k: int = 64,
                      num_stages: int = 3, threads: int = 256, swizzle: int = 8):
    """Kernel ``(x [m, k], w [experts, n, k], tile_expert, tile_row, tile_end [tiles], y [m, n])``,
    as :func:`grouped_gemm.grouped_gemm_bf16`. ``threads`` must be a multiple of 128 (each warp
    reads only its quarter of TMEM's 128 lanes) and the tile must fit one tcgen05 accumulator."""
    if block_m not in (64, 128) or block_n % 16 or not 16 <= block_n <= 256 or threads % 128:
        raise ValueError(f"grouped_gemm_bf16 (tcgen05): block_m={block_m} must be 64 or 128, block_n={block_n} a "
                         f"multiple of 16 up to 256, threads={threads} a multiple of 128")
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    dtype, accum = "bfloat16", "float"
    k_blocks = -(-k // block_k)

    @T.prim_func
    def kernel(x: T.Tensor((m, k), dtype), w: T.Tensor((experts, n, k), dtype),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=threads) as (bn, bt):
            x_ring = T.alloc_shared((num_stages, block_m, block_k), dtype)
            w_ring = T.alloc_shared((num_stages, block_n, block_k), dtype)
            acc_tmem = T.alloc_tmem((block_m, block_n), accum)
            acc = T.alloc_fragment((block_m, block_n), accum)
            loaded = T.alloc_barrier([32] * num_stages)  # the 32 threads of the TMA warp
            consumed = T.alloc_barrier([1] * num_stages)  # one tcgen05.commit
            done = T.alloc_barrier(1)
            thread = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle)  # runs panels of `swizzle` tiles across n: each weight tile read once
            if tile_expert[bt] < experts:
                row, expert = tile_row[bt], tile_expert[bt]
                if thread < 32:
                    for kb in T.serial(k_blocks):
                        stage = kb % num_stages
                        T.mbarrier_wait_parity(consumed[stage], ((kb // num_stages) & 1) ^ 1)
                        T.tma_copy(x[row:row + block_m, kb * block_k:(kb + 1) * block_k], x_ring[stage, :, :],
                                   barrier=loaded[stage])
                        T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * block_k:(kb + 1) * block_k],
                                   w_ring[stage, :, :], barrier=loaded[stage])
                        T.mbarrier_arrive(loaded[stage])
                elif thread < 64:
                    for kb in T.serial(k_blocks):
                        stage = kb % num_stages
                        T.mbarrier_wait_parity(loaded[stage], (kb // num_stages) & 1)
                        T.tcgen05_gemm(x_ring[stage, :, :], w_ring[stage, :, :], acc_tmem, transpose_B=True,
                                       mbar=consumed[stage], clear_accum=kb == 0)
                    T.tcgen05_mma_arrive(done)
                T.mbarrier_wait_parity(done, 0)
                T.copy(acc_tmem, acc)
                # every warp has read its lanes before warp 0 frees the TMEM columns at the end
                T.tcgen05_before_thread_sync()
                T.sync_threads()
                for i, j in T.Parallel(block_m, block_n):
                    if i < tile_end[bt] - row:
                        y[row + i, bn * block_n + j] = T.cast(acc[i, j], dtype)

    return kernel


def main(experts: int = 8, n: int = 4096, k: int = 4096, rows_per_expert: int = 512) -> None:
    """Check against torch and time on the current GPU, which must be a Blackwell (sm_100a) one."""
    from tilelang.profiler import do_bench

    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(rows_per_expert // 2, rows_per_expert * 3 // 2, (experts,), generator=gen)
    x = torch.randn(int(sizes.sum()), k, generator=gen).to("cuda", torch.bfloat16)
    w = (k ** -0.5 * torch.randn(experts, n, k, generator=gen)).to("cuda", torch.bfloat16)
    sizes = sizes.cuda()
    schedule = tile_schedule(sizes, x.shape[0], 128)
    kernel = grouped_gemm_bf16(experts, n, k)

    def launch() -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        kernel(x, w, schedule[0], schedule[1], schedule[2], y)
        return y

    torch.testing.assert_close(launch(), reference(x, w, sizes), atol=2e-2, rtol=2e-2)
    ms = do_bench(launch)
    print(f"grouped_gemm_bf16 (tcgen05) m={x.shape[0]} n={n} k={k} experts={experts}: {ms:.3f} ms, "
          f"{2 * x.shape[0] * n * k / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
