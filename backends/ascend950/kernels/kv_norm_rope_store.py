"""The fused KV store on the ascend950 vector cores: ``rows`` key rows of ``dim`` in tiles of
``tile_rows`` rows, tile ``t`` run by vector core ``t % vector_cores``. A tile is copied into UB
(double-buffered by tile parity), normalised in float32 (RMSNorm with ``weight``, rounded to the
rows' dtype), its trailing ``rope_dim`` columns turned in float32 by each row's ``cos_sin`` row
(the RoPE kernel's tile code, :func:`~deepinfer_backends.ascend950.kernels.apply_rope.rope_macros`)
and rounded again: the keys. Each key row goes to its cache row ``slots[r]`` (``-1``: not stored)
in the cache format, and ``out`` gets what a reader of the cache sees, in the rows' dtype:

``bf16`` and ``index_bf16``: the keys themselves (the cache is passed as a bf16 ``[cache_rows,
dim]`` view of its byte rows). The quantized formats are refused (see
:func:`kv_norm_rope_store_kernel`); the emulation covers them.
Buffers, in the plan's order
(:func:`deepinfer_backends.ascend950.emulate.kv_norm_rope_store.plan_buffers`). The lowering
folds a buffer first written after another's last use into that one's storage, whatever the
planned offsets, so the rotation's buffers are cleared at the start of each tile, before any
buffer's last use."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects
from .apply_rope import rope_macros

BF16_FORMATS = ("bf16", "index_bf16")


def kv_norm_rope_store_kernel(rows: int, dim: int, rope_dim: int, table_rows: int, cache_rows: int,
                              tile_rows: int, vector_cores: int, eps: float, fmt: str, offsets: dict,
                              dtype: str = "bfloat16"):
    """The tilelang-ascend ``prim_func`` storing ``x [rows, dim]`` (bf16) normalised by ``weight
    [1, dim]`` (float32), rotated by ``cos_sin [table_rows, rope_dim]`` (float32) at ``positions
    [rows]`` (int32), in cache format ``fmt`` at ``slots [rows]`` (int32) of a ``cache_rows``-row
    cache, and returning the decoded keys in ``out``; ``rows`` a multiple of ``tile_rows``;
    ``offsets``: each UB buffer's byte offset by its plan name."""
    if fmt in ("fp4", "index_fp4"):
        raise NotImplementedError(f"kv_norm_rope_store_kernel cannot store format {fmt!r}: tilelang-ascend's language "
                                  f"has no e2m1 (FP4) type, so a tile can neither be cast to FP4 codes nor hold them; "
                                  f"the emulation (backend.execution=emulate) covers it")
    if fmt == "fp8":
        raise NotImplementedError("kv_norm_rope_store_kernel cannot store format 'fp8' yet: the UE8M0 scale needs int32 "
                                  "and byte views of float32 tiles, and tilelang-ascend 0.1.4 gives none that lowers "
                                  "(T.view fails to parse in a kernel body, 'Buffer() takes no arguments'; "
                                  "T.decl_buffer over an allocation's data crashes the lowering; a second allocation "
                                  "at the same address is folded elsewhere by the lowering's storage rewrite); "
                                  "the emulation (backend.execution=emulate) covers it")
    if fmt not in BF16_FORMATS:
        raise ValueError(f"kv_norm_rope_store_kernel stores formats {list(BF16_FORMATS)}, got {fmt!r}")
    if dtype != "bfloat16":
        raise ValueError(f"kv_norm_rope_store_kernel takes bfloat16 rows, got {dtype}")
    if rows % tile_rows:
        raise ValueError(f"kv_norm_rope_store_kernel takes whole tiles: rows={rows} is not a multiple of "
                         f"tile_rows={tile_rows}")
    if vector_cores % 2:
        raise ValueError(f"vector_cores={vector_cores}: an AI core pairs two vector cores")
    tiles = rows // tile_rows
    rounds = -(-tiles // vector_cores)
    count = tile_rows * dim
    import tilelang.language as T

    build_offsets, rotate, restore_offsets = rope_macros(T, tile_rows, rope_dim, False)

    @T.prim_func
    def kv_norm_rope_store(x: T.Tensor((rows, dim), dtype), weight: T.Tensor((1, dim), "float32"),
                           positions: T.Tensor((rows,), "int32"),
                           cos_sin: T.Tensor((table_rows, rope_dim), "float32"), slots: T.Tensor((rows,), "int32"),
                           cache: T.Tensor((cache_rows, dim), dtype),
                           out: T.Tensor((rows, dim), dtype)):
        with T.Kernel(vector_cores // 2, is_npu=True) as (block, sub):
            rows_in = T.alloc_ub((2, tile_rows, dim), dtype)
            work = T.alloc_ub((tile_rows, dim), "float32")
            squares = T.alloc_ub((tile_rows, dim), "float32")
            weight_ub = T.alloc_ub((1, dim), "float32")
            scale = T.alloc_ub((tile_rows,), "float32")
            slot_ub = T.alloc_ub((tile_rows,), "int32")
            rope = T.alloc_ub((tile_rows, rope_dim), "float32")
            partner = T.alloc_ub((tile_rows, rope_dim), "float32")
            cos = T.alloc_ub((tile_rows, rope_dim), "float32")
            sin = T.alloc_ub((tile_rows, rope_dim), "float32")
            table = T.alloc_ub((tile_rows, rope_dim), "float32")
            swap_offsets = T.alloc_ub((tile_rows, rope_dim), "uint32")
            cos_offsets = T.alloc_ub((tile_rows, rope_dim), "uint32")
            sin_offsets = T.alloc_ub((tile_rows, rope_dim), "uint32")
            sign = T.alloc_ub((tile_rows, rope_dim), "float32")
            T.annotate_address({rows_in: offsets["rows_in"], work: offsets["work"], squares: offsets["squares"],
                                weight_ub: offsets["weight"], scale: offsets["scale"], slot_ub: offsets["slots"],
                                rope: offsets["rope"], partner: offsets["partner"], cos: offsets["cos"],
                                sin: offsets["sin"], table: offsets["table"], swap_offsets: offsets["swap_offsets"],
                                cos_offsets: offsets["cos_offsets"], sin_offsets: offsets["sin_offsets"],
                                sign: offsets["sign"]})
            with T.Scope("V"):
                T.copy(weight, weight_ub)
                build_offsets(swap_offsets, cos_offsets, sin_offsets, sign)
                for step in T.serial(rounds):
                    tile = step * vector_cores + block * 2 + sub
                    slot = step % 2
                    if tile < tiles:
                        first = tile * tile_rows
                        T.copy(x[first:first + tile_rows, :], rows_in[slot, :, :])
                        T.copy(slots[first:first + tile_rows], slot_ub)
                        for r in T.serial(tile_rows):
                            T.copy(cos_sin[positions[first + r], :], table[r, :])
                        T.tile.fill(rope, 0.0)
                        T.tile.fill(partner, 0.0)
                        T.tile.fill(cos, 0.0)
                        T.tile.fill(sin, 0.0)
                        T.barrier_all()
                        T.tile.cast(work, rows_in[slot, :, :], "CAST_NONE", count)
                        T.tile.mul(squares, work, work)
                        T.reduce_sum(squares, scale, dim=-1)
                        T.tile.mul(scale, scale,
                                   1.0 / dim)
                        T.tile.add(scale, scale,
                                   eps)
                        T.tile.rsqrt(scale, scale)
                        T.tile.row_expand_mul(work, work, scale)
                        for r in T.serial(tile_rows):
                            T.tile.mul(work[r, :], work[r, :], weight_ub[0, :])
                        T.tile.cast(rows_in[slot, :, :], work, "CAST_RINT", count)
                        T.tile.cast(work, rows_in[slot, :, :], "CAST_NONE", count)
                        T.copy(work[:, dim - rope_dim:dim], rope)
                        rotate(rope, partner, cos, sin, table, swap_offsets, cos_offsets, sin_offsets, sign)
                        T.copy(rope, work[:, dim - rope_dim:dim])
                        T.tile.cast(rows_in[slot, :, :], work, "CAST_RINT", count)
                        restore_offsets(swap_offsets, cos_offsets, sin_offsets)
                        T.barrier_all()
                        for r in T.serial(tile_rows):
                            if slot_ub[r] >= 0:
                                T.copy(rows_in[slot, r, :], cache[slot_ub[r], :])
                        T.copy(rows_in[slot, :, :], out[first:first + tile_rows, :])

    return kv_norm_rope_store
