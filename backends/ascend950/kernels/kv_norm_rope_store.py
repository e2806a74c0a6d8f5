"""The fused KV store on the ascend950 vector cores: ``rows`` key rows of ``dim`` in tiles of
``tile_rows`` rows, tile ``t`` run by vector core ``t % vector_cores``. A tile is copied into UB
(double-buffered by tile parity), normalised in float32 (RMSNorm with ``weight``, rounded to the
rows' dtype), its trailing ``rope_dim`` columns turned in float32 by each row's ``cos_sin`` row
(the RoPE kernel's tile code, :func:`~deepinfer_backends.ascend950.kernels.apply_rope.rope_macros`)
and rounded again: the keys. Each key row goes to its cache row ``slots[r]`` (``-1``: not stored)
in the cache format, and ``out`` gets what a reader of the cache sees, in the rows' dtype:

``bf16`` and ``index_bf16``: the keys themselves (the cache is passed as a bf16 ``[cache_rows,
dim]`` view of its byte rows).

``fp8``: 528-byte rows, 512 e4m3 values then one UE8M0 byte per 32 values
(:func:`deepinfer.hal.formats.encode_tokens`). Each 32-value block's magnitude max (at least
``FP8_AMAX_FLOOR``) gives its scale byte from the max's float32 bits (:func:`fp8_scale_byte`,
scalar integer arithmetic through an int32 view of the maxima), the reciprocal and the scale
go back as float bits, the keys are multiplied by the reciprocal (exact, a power of two) and
rounded to e4m3; ``out`` is those values times the scale. The FP4 formats are refused (see
:func:`kv_norm_rope_store_kernel`); the emulation covers them.

Buffers, in the plan's order
(:func:`deepinfer_backends.ascend950.emulate.kv_norm_rope_store.plan_buffers`); the FP8 store
reads some through views placed at the same address (the squares tile as 32-value blocks, as
e4m3 values and as bytes; the maxima and reciprocals as int32 bits). The lowering folds a buffer
first written after another's last use into that one's storage, whatever the planned offsets, so
the rotation's buffers and the views are cleared at the start of each tile, before any buffer's
last use."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects
import types

from .apply_rope import rope_macros
from .mla_sparse_decode import CACHE_ROW_BYTES, FP8_GROUP

BF16_FORMATS = ("bf16", "index_bf16")
FP8_ROW_BYTES = CACHE_ROW_BYTES["fp8"]


def fp8_scale_byte(bits, shift_right):
    """UE8M0 byte of the least power of two at or above ``amax / 448``, from the float32 bits of
    ``amax`` (positive, normal, at least the floor), by ``shift_right`` (TIR's or torch's): with
    ``amax = m * 2^E``, ``m`` in [1, 2), the power is ``2^(E - 8)`` for ``m <= 1.75`` (448 is
    1.75 * 2^8) and ``2^(E - 7)`` above, and adding ``0x1FFFFF`` to the bits carries into the
    exponent field exactly when the mantissa field is above ``0x600000`` (``m > 1.75``)."""
    return shift_right(bits + 0x1FFFFF, 23) - 8


def kv_norm_rope_store_kernel(rows: int, dim: int, rope_dim: int, table_rows: int, cache_rows: int,
                              tile_rows: int, vector_cores: int, eps: float, fmt: str, offsets: dict,
                              dtype: str = "bfloat16", amax_floor: float | None = None):
    """The tilelang-ascend ``prim_func`` storing ``x [rows, dim]`` (bf16) normalised by ``weight
    [1, dim]`` (float32), rotated by ``cos_sin [table_rows, rope_dim]`` (float32) at ``positions
    [rows]`` (int32), in cache format ``fmt`` at ``slots [rows]`` (int32) of a ``cache_rows``-row
    cache (bf16 ``[cache_rows, dim]`` for the bf16 formats, uint8 ``[cache_rows, 528]`` for
    ``fp8``), and returning the decoded keys in ``out``; ``rows`` a multiple of ``tile_rows``;
    ``offsets``: each UB buffer's byte offset by its plan name; ``amax_floor``: the least block max
    an ``fp8`` scale is taken from (:data:`deepinfer.hal.formats.FP8_AMAX_FLOOR`; ``fp8`` only)."""
    if fmt in ("fp4", "index_fp4"):
        raise NotImplementedError(f"kv_norm_rope_store_kernel cannot store format {fmt!r}: tilelang-ascend's language "
                                  f"has no e2m1 (FP4) type, so a tile can neither be cast to FP4 codes nor hold them; "
                                  f"the emulation (backend.execution=emulate) covers it")
    if fmt not in (*BF16_FORMATS, "fp8"):
        raise ValueError(f"kv_norm_rope_store_kernel stores formats {[*BF16_FORMATS, 'fp8']}, got {fmt!r}")
    if dtype != "bfloat16":
        raise ValueError(f"kv_norm_rope_store_kernel takes bfloat16 rows, got {dtype}")
    if rows % tile_rows:
        raise ValueError(f"kv_norm_rope_store_kernel takes whole tiles: rows={rows} is not a multiple of "
                         f"tile_rows={tile_rows}")
    if vector_cores % 2:
        raise ValueError(f"vector_cores={vector_cores}: an AI core pairs two vector cores")
    quantized = fmt == "fp8"
    if quantized and dim + dim // FP8_GROUP != FP8_ROW_BYTES:
        raise ValueError(f"an fp8 cache row holds 512 values, not dim={dim}")
    if quantized and amax_floor is None:
        raise ValueError("an fp8 store takes amax_floor, the least block max a scale is taken from")
    tiles = rows // tile_rows
    rounds = -(-tiles // vector_cores)
    count = tile_rows * dim
    blocks = count // FP8_GROUP
    per_row = dim // FP8_GROUP
    cache_shape, cache_dtype = ((cache_rows, FP8_ROW_BYTES), "uint8") if quantized else ((cache_rows, dim), dtype)
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    build_offsets, rotate, restore_offsets = rope_macros(T, tile_rows, rope_dim, False)

    def fp8_views():
        """The FP8 store's buffers (None for the bf16 formats): the block maxima and the
        reciprocals, and views at their addresses: the squares tile as 32-value blocks, as e4m3
        values and as bytes, the working tile as blocks, the maxima and reciprocals as int32."""
        if not quantized:
            return None
        views = dict(block_max=T.alloc_ub((blocks,), "float32"), recip=T.alloc_ub((blocks,), "float32"),
                     max_bits=T.alloc_ub((blocks,), "int32"), recip_bits=T.alloc_ub((blocks,), "int32"),
                     magnitudes=T.alloc_ub((blocks, FP8_GROUP), "float32"),
                     work_blocks=T.alloc_ub((blocks, FP8_GROUP), "float32"),
                     codes=T.alloc_ub((tile_rows, dim), "e4m3_float8"),
                     code_bytes=T.alloc_ub((4 * tile_rows, dim), "uint8"))
        for name, buffer in views.items():
            IRBuilder.name(name, buffer)
        place = dict(block_max="block_max", recip="recip", max_bits="block_max", recip_bits="recip",
                     magnitudes="squares", work_blocks="work", codes="squares", code_bytes="squares")
        T.annotate_address({buffer: offsets[place[name]] for name, buffer in views.items()})
        return types.SimpleNamespace(**views)

    @T.macro
    def clear_views(q):
        """Every view written first, at the tile's start, so the lowering keeps it at its address;
        after a barrier, since the last tile's stores may still be reading the codes."""
        if quantized:
            T.barrier_all()
            T.tile.fill(q.code_bytes, 0)
            T.tile.fill(q.codes, 0.0)
            T.tile.fill(q.magnitudes, 0.0)
            T.tile.fill(q.work_blocks, 0.0)
            T.tile.fill(q.max_bits, 0)
            T.tile.fill(q.recip_bits, 0)
            T.tile.fill(q.block_max, 0.0)
            T.tile.fill(q.recip, 0.0)

    @T.macro
    def quantize_fp8(keys_in, work, squares, q):
        """The tile's keys (``work``, float32 of the rounded keys) to e4m3 codes and scale bytes in
        ``q``'s views, and what a reader decodes from them into ``keys_in`` (exact)."""
        T.tile.abs(squares, work)
        T.reduce_max(q.magnitudes, q.block_max, dim=-1)
        T.tile.max(q.block_max, q.block_max, amax_floor)
        T.barrier_all()
        for b in T.serial(blocks):
            byte = fp8_scale_byte(q.max_bits[b], T.shift_right)
            q.code_bytes[tile_rows + b // per_row, b % per_row] = T.Cast("uint8", byte)
            q.recip_bits[b] = T.shift_left(254 - byte, 23)
            q.max_bits[b] = T.shift_left(byte, 23)
        T.barrier_all()
        T.tile.row_expand_mul(q.work_blocks, q.work_blocks, q.recip)
        T.tile.cast(q.codes, work, "CAST_RINT", count)
        T.tile.cast(work, q.codes, "CAST_NONE", count)
        T.tile.row_expand_mul(q.work_blocks, q.work_blocks, q.block_max)
        T.tile.cast(keys_in, work, "CAST_RINT", count)

    @T.macro
    def store_row(rows_in, slot, r, slot_row, cache, q):
        """Row ``r`` of the tile into cache row ``slot_row``: the e4m3 bytes and scale bytes, or the
        bf16 keys (``rows_in[slot]``)."""
        if quantized:
            T.copy(q.code_bytes[r, :], cache[slot_row, 0:dim])
            T.copy(q.code_bytes[tile_rows + r, 0:per_row], cache[slot_row, dim:FP8_ROW_BYTES])
        else:
            T.copy(rows_in[slot, r, :], cache[slot_row, :])

    @T.prim_func
    def kv_norm_rope_store(x: T.Tensor((rows, dim), dtype), weight: T.Tensor((1, dim), "float32"),
                           positions: T.Tensor((rows,), "int32"),
                           cos_sin: T.Tensor((table_rows, rope_dim), "float32"), slots: T.Tensor((rows,), "int32"),
                           cache: T.Tensor(cache_shape, cache_dtype),
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
            q = T.meta_var(fp8_views())
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
                        clear_views(q)
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
                        if quantized:
                            T.tile.cast(work, rows_in[slot, :, :], "CAST_NONE", count)
                            quantize_fp8(rows_in[slot, :, :], work, squares, q)
                        T.barrier_all()
                        for r in T.serial(tile_rows):
                            if slot_ub[r] >= 0:
                                store_row(rows_in, slot, r, slot_ub[r], cache, q)
                        T.copy(rows_in[slot, :, :], out[first:first + tile_rows, :])

    return kv_norm_rope_store
