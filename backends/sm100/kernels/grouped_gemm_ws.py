"""Warp-specialised grouped bf16 GEMM: ``y[seg e] = x[seg e] @ w[e].T``, with hand-placed barriers.

Same contract, grid and tile schedule as :func:`~deepinfer_backends.sm100.kernels.grouped_gemm.grouped_gemm_bf16`
(contiguous expert segments, one compile per ``(experts, n, k)``, one CTA per output tile in the
same rasterised order, so the CTAs that read one weight tile run together and share it in L2).
What the automatic pipeline cannot express:

- a producer warpgroup streams ``x`` and weight tiles by TMA into a ``num_stages`` ring;
- two consumer warpgroups (64 rows each of a 128-row tile) issue their wgmmas asynchronously and
  keep one k-block in flight: the ring slot of block ``kb - 1`` is released once block ``kb``'s
  wgmmas are issued and ``kb - 1``'s have retired;
- on a segment's last tile with at most 64 rows the second warpgroup issues no wgmma at all, so
  the tile takes about half the tensor-core time. Routing rarely fills whole tiles: with about 256
  rows per expert, half the segments end in such a tile;
- the output tile goes through the weight ring and leaves as 16-byte stores (:func:`store_tile`;
  faster on the MoE shapes than 4-byte stores from the accumulator layout, each of which a warp
  spreads over 8 rows; ``experiments/results/grouped_gemm_kernels_h200.txt``)."""
import tilelang
import tilelang.language as T

_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
CONSUMERS = 256  # two consumer warpgroups; the producer warpgroup follows them
CONSUMERS_BAR = 1  # named barrier of the consumer warpgroups (0 is __syncthreads)


@T.macro
def consume(x_s, w_s, acc, full, empty, live, tx, k_blocks: int, num_stages: int, block_m: int, rows):
    """The two consumer warpgroups' main loop over the ``full`` / ``empty`` ring of ``x_s`` and
    ``w_s``: async wgmmas into ``acc`` with one k-block in flight; a warpgroup whose 64 rows all lie
    past the tile's ``rows`` (``block_m`` 128) issues none. Ends with every wgmma retired."""
    policy = T.GemmWarpPolicy.FullRow if block_m == 128 else T.GemmWarpPolicy.FullCol
    live[0] = T.if_then_else(block_m == 64 or (tx // 128) * 64 < rows, 1, 0)
    for kb in T.serial(k_blocks):
        T.barrier_wait(full[kb % num_stages], (kb // num_stages) & 1)
        if live[0]:
            T.wgmma_gemm(x_s[kb % num_stages, :, :], w_s[kb % num_stages, :, :], acc, transpose_B=True,
                         policy=policy, clear_accum=kb == 0)
        T.wait_wgmma(1)
        if kb > 0:
            T.barrier_arrive(empty[(kb - 1) % num_stages])
    T.wait_wgmma(0)


@T.macro
def store_tile(acc, w_s, y, row0, rows, bn, block_m: int, block_n: int, block_k: int, num_stages: int, dtype: str):
    """The consumers' output tile ``acc`` -> ``y[row0 : row0 + rows, bn * block_n :]``, through the
    weight ring (free once both warpgroups' wgmmas have retired; column block ``c`` of 64 in stage
    ``c``) so that the stores to global memory are whole 16-byte vectors of consecutive addresses:
    4-byte stores straight from the accumulator layout spread each warp's store over 8 rows.
    Straight stores where the ring cannot hold the tile."""
    if block_n <= num_stages * block_k and block_m <= block_n:
        T.sync_threads(CONSUMERS_BAR, CONSUMERS)  # both warpgroups are done with the ring
        for i, j in T.Parallel(block_m, block_n):
            w_s[j // block_k, i, j % block_k] = T.cast(acc[i, j], dtype)
        T.sync_threads(CONSUMERS_BAR, CONSUMERS)
        for i, j in T.Parallel(block_m, block_n):
            if i < rows:
                y[row0 + i, bn * block_n + j] = w_s[j // block_k, i, j % block_k]
    else:
        for i, j in T.Parallel(block_m, block_n):
            if i < rows:
                y[row0 + i, bn * block_n + j] = T.cast(acc[i, j], dtype)


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_bf16_ws(experts: int, n: int, k: int, block_m: int = 128, block_n: int = 256, block_k: int = 64,
                         num_stages: int = 4, swizzle: int = 8):
    """Kernel ``(x [m, k], w [experts, n, k], tile_expert, tile_row, tile_end [tiles], y [m, n])`` as
    :func:`~deepinfer_backends.sm100.kernels.grouped_gemm.grouped_gemm_bf16` (``tile_expert[t] >=
    experts`` marks an unused tile). ``block_m`` 128 (a warpgroup per 64 rows) or 64 (the two
    warpgroups split the columns)."""
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    dtype, accum = "bfloat16", "float"
    k_blocks = -(-k // block_k)

    @T.prim_func
    def kernel(x: T.Tensor((m, k), dtype), w: T.Tensor((experts, n, k), dtype),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=CONSUMERS + 128) as (bn, bt):
            x_s = T.alloc_shared((num_stages, block_m, block_k), dtype)
            w_s = T.alloc_shared((num_stages, block_n, block_k), dtype)
            acc = T.alloc_fragment((block_m, block_n), accum)
            full = T.alloc_barrier([1] * num_stages)
            empty = T.alloc_barrier([CONSUMERS] * num_stages)
            live = T.alloc_local((1,), "int32")  # this warpgroup's rows hold some of the tile's rows
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle)  # as grouped_gemm_bf16: readers of one weight tile run together
            if tile_expert[bt] < experts:
                if tx >= CONSUMERS:  # producer
                    T.set_max_nreg(40, 0)
                    for kb in T.serial(k_blocks):
                        slot = kb % num_stages
                        T.barrier_wait(empty[slot], ((kb // num_stages) & 1) ^ 1)
                        T.tma_copy(x[tile_row[bt]:tile_row[bt] + block_m, kb * block_k:(kb + 1) * block_k],
                                   x_s[slot, :, :], barrier=full[slot])
                        T.tma_copy(w[tile_expert[bt], bn * block_n:(bn + 1) * block_n, kb * block_k:(kb + 1) * block_k],
                                   w_s[slot, :, :], barrier=full[slot], annotations={"emit_arrive": 1})
                else:  # consumers
                    T.set_max_nreg(232, 1)
                    consume(x_s, w_s, acc, full, empty, live, tx, k_blocks, num_stages, block_m,
                            tile_end[bt] - tile_row[bt])
                    store_tile(acc, w_s, y, tile_row[bt], tile_end[bt] - tile_row[bt], bn, block_m, block_n, block_k,
                               num_stages, dtype)

    return kernel


def main() -> None:
    """Check the warp-specialised bf16 grouped GEMM against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("grouped_gemm")


if __name__ == "__main__":
    main()
