"""RMSNorm on the ascend950 vector cores: ``rows`` rows of ``dim`` split into tiles of
``tile_rows`` rows, tile ``t`` run by vector core ``t % vector_cores`` (two vector cores an AI
core, so block ``b``'s cores are ``2b`` and ``2b + 1``). A tile is copied into UB, widened to
float32, summed with the residual tile (the sum rounded to the residual's dtype, stored back as
the new residual), its squares summed per row, scaled by ``rsqrt(sum / dim + eps)`` and the weight,
rounded once into the input tile's slot, and copied out. Buffers, in the plan's order
(:func:`deepinfer_backends.ascend950.emulate.rms_norm.plan_buffers`): ``rows_in`` and
``residual`` double-buffered by tile parity, the float32 ``work`` and ``squares`` tiles, the
weight row and the per-row scale; the row reduction's scratch follows them."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects


def rms_norm_kernel(rows: int, dim: int, tile_rows: int, vector_cores: int, eps: float,
                    offsets: dict, dtype: str = "bfloat16"):
    """The tilelang-ascend ``prim_func`` of one RMSNorm with a residual; ``rows`` a multiple of
    ``tile_rows`` (callers pad the last tile); ``weight`` float32; ``offsets``: each UB
    buffer's byte offset by its plan name (``rows_in``, ``residual``, ``work``, ``squares``,
    ``weight``, ``scale``), as :func:`deepinfer_backends.ascend950.buffers.layout` places them."""
    import tilelang.language as T

    if rows % tile_rows:
        raise ValueError(f"rms_norm_kernel takes whole tiles: rows={rows} is not a multiple of tile_rows={tile_rows}")
    if vector_cores % 2:
        raise ValueError(f"vector_cores={vector_cores}: an AI core pairs two vector cores")
    tiles = rows // tile_rows
    rounds = -(-tiles // vector_cores)
    count = tile_rows * dim

    @T.prim_func
    def rms_norm(x: T.Tensor((rows, dim), dtype), residual: T.Tensor((rows, dim), dtype),
                 weight: T.Tensor((1, dim), "float32"), out: T.Tensor((rows, dim), dtype)):
        with T.Kernel(vector_cores // 2, is_npu=True) as (block, sub):
            rows_in = T.alloc_ub((2, tile_rows, dim), dtype)
            residual_ub = T.alloc_ub((2, tile_rows, dim), dtype)
            work = T.alloc_ub((tile_rows, dim), "float32")
            squares = T.alloc_ub((tile_rows, dim), "float32")
            weight_ub = T.alloc_ub((1, dim), "float32")
            scale = T.alloc_ub((tile_rows,), "float32")
            T.annotate_address({rows_in: offsets["rows_in"], residual_ub: offsets["residual"],
                                work: offsets["work"], squares: offsets["squares"],
                                weight_ub: offsets["weight"], scale: offsets["scale"]})
            with T.Scope("V"):
                T.copy(weight, weight_ub)
                for step in T.serial(rounds):
                    tile = step * vector_cores + block * 2 + sub
                    slot = step % 2
                    if tile < tiles:
                        first = tile * tile_rows
                        T.copy(x[first:first + tile_rows, :], rows_in[slot, :, :])
                        T.copy(residual[first:first + tile_rows, :], residual_ub[slot, :, :])
                        T.barrier_all()
                        T.tile.cast(work, rows_in[slot, :, :], "CAST_NONE", count)
                        T.tile.cast(squares, residual_ub[slot, :, :], "CAST_NONE", count)
                        T.tile.add(work, work, squares)
                        T.tile.cast(residual_ub[slot, :, :], work, "CAST_RINT", count)
                        T.tile.cast(work, residual_ub[slot, :, :], "CAST_NONE", count)
                        T.tile.mul(squares, work, work)
                        T.reduce_sum(squares, scale, dim=-1)
                        T.tile.mul(scale, scale, 1.0 / dim)
                        T.tile.add(scale, scale, eps)
                        T.tile.rsqrt(scale, scale)
                        T.tile.row_expand_mul(work, work, scale)
                        for r in T.serial(tile_rows):
                            T.tile.mul(work[r, :], work[r, :], weight_ub[0, :])
                        T.tile.cast(rows_in[slot, :, :], work, "CAST_RINT", count)
                        T.barrier_all()
                        T.copy(residual_ub[slot, :, :], residual[first:first + tile_rows, :])
                        T.copy(rows_in[slot, :, :], out[first:first + tile_rows, :])

    return rms_norm
