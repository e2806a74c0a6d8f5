"""Warp-specialised grouped bf16 GEMM of the gate and up weights with the clamped SwiGLU in its
epilogue: ``y[seg e] = swiglu(x[seg e] @ w1[e].T, x[seg e] @ w3[e].T)``.

The grid, tile schedule, producer and consumers are those of
:func:`~deepinfer_backends.sm100.kernels.grouped_gemm_ws.grouped_gemm_bf16_ws`, with each weight
stage holding ``block_n`` rows of the gate and then ``block_n`` rows of the up weight, so one
wgmma sequence fills a ``[block_m, 2 * block_n]`` accumulator: the gate's products on the left,
the up's on the right. The epilogue rounds both to bf16 in shared memory (the products the
unfused op stores), then computes the SwiGLU in float32 and stores one bf16 tile; the two
products never reach global memory."""
import tilelang
import tilelang.language as T

from deepinfer_backends.sm100.kernels.grouped_gemm_ws import _PASS_CONFIGS, CONSUMERS, CONSUMERS_BAR, consume


@T.macro
def store_swiglu(acc, w_s, y, row0, rows, bn, block_m: int, block_n: int, block_k: int, limit, clamp: bool):
    """``acc``'s two halves rounded to bf16 through the weight ring (column block ``c`` of
    ``block_k`` in stage ``c``), then ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in
    float32 -> ``y[row0 : row0 + rows, bn * block_n :]`` in bf16."""
    T.sync_threads(CONSUMERS_BAR, CONSUMERS)  # both warpgroups are done with the ring
    for i, j in T.Parallel(block_m, 2 * block_n):
        w_s[j // block_k, i, j % block_k] = T.cast(acc[i, j], "bfloat16")
    T.sync_threads(CONSUMERS_BAR, CONSUMERS)
    for i, j in T.Parallel(block_m, block_n):
        if i < rows:
            gate = T.cast(w_s[j // block_k, i, j % block_k], "float")
            up = T.cast(w_s[(block_n + j) // block_k, i, (block_n + j) % block_k], "float")
            if clamp:
                gate = T.min(gate, limit)
                up = T.min(T.max(up, -limit), limit)
            y[row0 + i, bn * block_n + j] = T.cast(gate / (1.0 + T.exp(-gate)) * up, "bfloat16")


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_swiglu_bf16_ws(experts: int, n: int, k: int, limit: float | None, block_m: int = 128,
                           block_n: int = 128, block_k: int = 64, num_stages: int = 4, swizzle: int = 8):
    """Kernel ``(x [m, k], w1 [experts, n, k], w3 [experts, n, k], tile_expert, tile_row, tile_end
    [tiles], y [m, n])`` with the grouped GEMM's tile schedule (``tile_expert[t] >= experts``
    marks an unused tile); ``block_n`` output columns a CTA, read from ``block_n`` rows of each
    weight; ``limit`` None clamps nothing. The ring must hold the ``2 * block_n``-wide tile:
    ``2 * block_n <= num_stages * block_k``."""
    assert 2 * block_n <= num_stages * block_k and block_m <= 2 * block_n, "the ring cannot hold the output tile"
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    dtype, accum = "bfloat16", "float"
    k_blocks = -(-k // block_k)
    clamp = limit is not None
    bound = float(limit) if clamp else 0.0

    @T.prim_func
    def kernel(x: T.Tensor((m, k), dtype), w1: T.Tensor((experts, n, k), dtype), w3: T.Tensor((experts, n, k), dtype),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=CONSUMERS + 128) as (bn, bt):
            x_s = T.alloc_shared((num_stages, block_m, block_k), dtype)
            w_s = T.alloc_shared((num_stages, 2 * block_n, block_k), dtype)
            acc = T.alloc_fragment((block_m, 2 * block_n), accum)
            full = T.alloc_barrier([1] * num_stages)
            empty = T.alloc_barrier([CONSUMERS] * num_stages)
            live = T.alloc_local((1,), "int32")
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle)
            if tile_expert[bt] < experts:
                if tx >= CONSUMERS:  # producer
                    T.set_max_nreg(40, 0)
                    for kb in T.serial(k_blocks):
                        slot = kb % num_stages
                        cols = (bn * block_n, kb * block_k)
                        T.barrier_wait(empty[slot], ((kb // num_stages) & 1) ^ 1)
                        T.tma_copy(x[tile_row[bt]:tile_row[bt] + block_m, kb * block_k:(kb + 1) * block_k],
                                   x_s[slot, :, :], barrier=full[slot])
                        T.tma_copy(w1[tile_expert[bt], cols[0]:cols[0] + block_n, cols[1]:cols[1] + block_k],
                                   w_s[slot, 0:block_n, :], barrier=full[slot])
                        T.tma_copy(w3[tile_expert[bt], cols[0]:cols[0] + block_n, cols[1]:cols[1] + block_k],
                                   w_s[slot, block_n:2 * block_n, :], barrier=full[slot],
                                   annotations={"emit_arrive": 1})
                else:  # consumers
                    T.set_max_nreg(232, 1)
                    consume(x_s, w_s, acc, full, empty, live, tx, k_blocks, num_stages, block_m,
                            tile_end[bt] - tile_row[bt])
                    store_swiglu(acc, w_s, y, tile_row[bt], tile_end[bt] - tile_row[bt], bn, block_m, block_n,
                                 block_k, bound, clamp)

    return kernel


def main() -> None:
    """Check the fused gate/up SwiGLU kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("grouped_swiglu")


if __name__ == "__main__":
    main()
