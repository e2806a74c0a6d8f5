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
rounded to e4m3; ``out`` is those values times the scale.

``index_fp4``: 68-byte rows, 128 e2m1 codes packed two a byte (the even value in the low
nibble) then one UE8M0 byte per 32 values. The scale byte comes from the block max (at least
``MXFP4_AMAX_FLOOR``) as for ``fp8`` (:func:`mxfp4_scale_byte`); tilelang-ascend has no e2m1
type, so the keys times the reciprocal are rounded to e2m1 in float32 arithmetic: each step of
:data:`E2M1_STEPS` is ``clamp((|v| - t) * 2^30 [+ 1], 0, 1)``, exactly 0 or 1, summed into the
code and, by its value, into the decoded magnitude; the sign adds 8 (a ``-0.0`` key keeps code
0, which decodes to the same zero). A gather pairs the codes (evens, then odds), ``low + 16 *
high`` goes through half to bytes; ``out`` is the decoded values times the scale. ``fp4`` (e4m3
scales per 16) is refused (see :func:`kv_norm_rope_store_kernel`); the emulation covers it.

Buffers, in the plan's order
(:func:`deepinfer_backends.ascend950.emulate.kv_norm_rope_store.plan_buffers`); the quantizing
stores read some through views placed at the same address (the squares and working tiles as
32-value blocks, the maxima and reciprocals as int32 bits; for ``fp8`` the squares tile as
e4m3 values and as bytes; for ``index_fp4`` the decoded values as blocks, the paired codes'
halves and the packed bytes' data rows). The lowering folds a buffer
first written after another's last use into that one's storage, whatever the planned offsets, so
the rotation's buffers and the views are cleared at the start of each tile, before any buffer's
last use."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects
import types

from .apply_rope import rope_macros
from .mla_sparse_decode import CACHE_ROW_BYTES, FP8_GROUP

BF16_FORMATS = ("bf16", "index_bf16")
FP8_ROW_BYTES = CACHE_ROW_BYTES["fp8"]
INDEX_FP4_ROW_BYTES = 68
"""An ``index_fp4`` row: 64 bytes of packed e2m1 codes (128 values), then 4 UE8M0 scale bytes."""
E2M1_STEPS = ((0.25, False, 0.5), (0.75, True, 0.5), (1.25, False, 0.5), (1.75, True, 0.5), (2.5, False, 1.0),
              (3.5, True, 1.0), (5.0, False, 2.0))
"""e2m1's rounding of a magnitude, nearest with ties to the even code, as steps: ``(threshold,
whether a magnitude equal to it steps up, value added)``; the code is the number of steps taken,
the value the sum of their additions (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""


def mxfp4_scale_byte(bits, shift_right):
    """UE8M0 byte of the least power of two at or above ``amax / 6``, from the float32 bits of
    ``amax`` (positive, normal, at least the floor), by ``shift_right``: with ``amax = m * 2^E``
    the power is ``2^(E - 2)`` for ``m <= 1.5`` (6 is 1.5 * 2^2) and ``2^(E - 1)`` above, and
    adding ``0x3FFFFF`` carries into the exponent field exactly when the mantissa field is above
    ``0x400000``."""
    return shift_right(bits + 0x3FFFFF, 23) - 2


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
    ``fp8``, ``[cache_rows, 68]`` for ``index_fp4``), and returning the decoded keys in ``out``;
    ``rows`` a multiple of ``tile_rows``; ``offsets``: each UB buffer's byte offset by its plan
    name; ``amax_floor``: the least block max a scale is taken from
    (:data:`deepinfer.hal.formats.FP8_AMAX_FLOOR` for ``fp8``, ``MXFP4_AMAX_FLOOR`` for
    ``index_fp4``; the quantized formats only)."""
    if fmt == "fp4":
        raise NotImplementedError("kv_norm_rope_store_kernel does not store format 'fp4' yet (e2m1 with e4m3 scales "
                                  "per 16, whose reciprocals are rounded divisions); the emulation "
                                  "(backend.execution=emulate) covers it")
    if fmt not in (*BF16_FORMATS, "fp8", "index_fp4"):
        raise ValueError(f"kv_norm_rope_store_kernel stores formats {[*BF16_FORMATS, 'fp8', 'index_fp4']}, got {fmt!r}")
    if dtype != "bfloat16":
        raise ValueError(f"kv_norm_rope_store_kernel takes bfloat16 rows, got {dtype}")
    if rows % tile_rows:
        raise ValueError(f"kv_norm_rope_store_kernel takes whole tiles: rows={rows} is not a multiple of "
                         f"tile_rows={tile_rows}")
    if vector_cores % 2:
        raise ValueError(f"vector_cores={vector_cores}: an AI core pairs two vector cores")
    fp4 = fmt == "index_fp4"
    quantized = fmt == "fp8" or fp4
    if fmt == "fp8" and dim + dim // FP8_GROUP != FP8_ROW_BYTES:
        raise ValueError(f"an fp8 cache row holds 512 values, not dim={dim}")
    if fp4 and dim // 2 + dim // FP8_GROUP != INDEX_FP4_ROW_BYTES:
        raise ValueError(f"an index_fp4 cache row holds 128 values, not dim={dim}")
    if quantized and amax_floor is None:
        raise ValueError(f"an {fmt} store takes amax_floor, the least block max a scale is taken from")
    tiles = rows // tile_rows
    rounds = -(-tiles // vector_cores)
    count = tile_rows * dim
    blocks = count // FP8_GROUP
    per_row = dim // FP8_GROUP
    half = dim // 2
    row_bytes = INDEX_FP4_ROW_BYTES if fp4 else FP8_ROW_BYTES
    cache_shape, cache_dtype = ((cache_rows, row_bytes), "uint8") if quantized else ((cache_rows, dim), dtype)
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    build_offsets, rotate, restore_offsets = rope_macros(T, tile_rows, rope_dim, False)

    def quant_views():
        """The quantizing stores' buffers (None for the bf16 formats): the block maxima and the
        reciprocals, and views at their addresses: the squares tile and the working tile as
        32-value blocks, the maxima and reciprocals as int32; for ``fp8`` the squares tile as e4m3
        values and as bytes; for ``index_fp4`` the FP4 buffers of the plan and the decoded values
        as blocks."""
        if not quantized:
            return None
        views = dict(block_max=T.alloc_ub((blocks,), "float32"), recip=T.alloc_ub((blocks,), "float32"),
                     max_bits=T.alloc_ub((blocks,), "int32"), recip_bits=T.alloc_ub((blocks,), "int32"),
                     magnitudes=T.alloc_ub((blocks, FP8_GROUP), "float32"),
                     work_blocks=T.alloc_ub((blocks, FP8_GROUP), "float32"))
        place = dict(block_max="block_max", recip="recip", max_bits="block_max", recip_bits="recip",
                     magnitudes="squares", work_blocks="work")
        if fp4:
            views.update(steps=T.alloc_ub((tile_rows, dim), "float32"), codes=T.alloc_ub((tile_rows, dim), "float32"),
                         decoded=T.alloc_ub((tile_rows, dim), "float32"),
                         decoded_blocks=T.alloc_ub((blocks, FP8_GROUP), "float32"),
                         pairs=T.alloc_ub((2 * tile_rows, half), "float32"),
                         low_codes=T.alloc_ub((tile_rows, half), "float32"),
                         high_codes=T.alloc_ub((tile_rows, half), "float32"),
                         pair_offsets=T.alloc_ub((2 * tile_rows, half), "uint32"),
                         byte_half=T.alloc_ub((tile_rows, half), "float16"),
                         packed=T.alloc_ub((2 * tile_rows, half), "uint8"),
                         code_bytes=T.alloc_ub((tile_rows, half), "uint8"))
            place.update(steps="steps", codes="codes", decoded="decoded", decoded_blocks="decoded", pairs="pairs",
                         low_codes="pairs", high_codes=("pairs", tile_rows * half * 4), pair_offsets="pair_offsets",
                         byte_half="byte_half", packed="packed", code_bytes="packed")
        else:
            views.update(codes=T.alloc_ub((tile_rows, dim), "e4m3_float8"),
                         code_bytes=T.alloc_ub((4 * tile_rows, dim), "uint8"))
            place.update(codes="squares", code_bytes="squares")
        for name, buffer in views.items():
            IRBuilder.name(name, buffer)
        T.annotate_address({buffer: offsets[place[name]] if isinstance(place[name], str)
                            else offsets[place[name][0]] + place[name][1] for name, buffer in views.items()})
        return types.SimpleNamespace(**views)

    @T.macro
    def clear_views(q):
        """Every view written first, at the tile's start, so the lowering keeps it at its address;
        after a barrier, since the last tile's stores may still be reading the codes."""
        if quantized:
            T.barrier_all()
            if fp4:
                T.tile.fill(q.packed, 0)
                T.tile.fill(q.code_bytes, 0)
                T.tile.fill(q.byte_half, 0.0)
                T.tile.fill(q.pairs, 0.0)
                T.tile.fill(q.low_codes, 0.0)
                T.tile.fill(q.high_codes, 0.0)
                T.tile.fill(q.decoded_blocks, 0.0)
                T.tile.fill(q.decoded, 0.0)
                T.tile.fill(q.steps, 0.0)
            else:
                T.tile.fill(q.code_bytes, 0)
            T.tile.fill(q.codes, 0.0)
            T.tile.fill(q.magnitudes, 0.0)
            T.tile.fill(q.work_blocks, 0.0)
            T.tile.fill(q.max_bits, 0)
            T.tile.fill(q.recip_bits, 0)
            T.tile.fill(q.block_max, 0.0)
            T.tile.fill(q.recip, 0.0)

    scale_byte = mxfp4_scale_byte if fp4 else fp8_scale_byte

    @T.macro
    def block_scales(work, squares, q, scale_bytes):
        """Each 32-value block's max (at least the floor) to its UE8M0 byte (:func:`scale_byte`,
        at row ``tile_rows + r`` of ``scale_bytes``), its scale's and reciprocal's bits into the
        maxima and reciprocals, and the keys in ``work`` times their reciprocal (exact)."""
        T.tile.abs(squares, work)
        T.reduce_max(q.magnitudes, q.block_max, dim=-1)
        T.tile.max(q.block_max, q.block_max, amax_floor)
        T.barrier_all()
        for b in T.serial(blocks):
            byte = scale_byte(q.max_bits[b], T.shift_right)
            scale_bytes[tile_rows + b // per_row, b % per_row] = T.Cast("uint8", byte)
            q.recip_bits[b] = T.shift_left(254 - byte, 23)
            q.max_bits[b] = T.shift_left(byte, 23)
        T.barrier_all()
        T.tile.row_expand_mul(q.work_blocks, q.work_blocks, q.recip)

    @T.macro
    def quantize_fp8(keys_in, work, squares, q):
        """The tile's keys (``work``, float32 of the rounded keys) to e4m3 codes and scale bytes in
        ``q``'s views, and what a reader decodes from them into ``keys_in`` (exact)."""
        block_scales(work, squares, q, q.code_bytes)
        T.tile.cast(q.codes, work, "CAST_RINT", count)
        T.tile.cast(work, q.codes, "CAST_NONE", count)
        T.tile.row_expand_mul(q.work_blocks, q.work_blocks, q.block_max)
        T.tile.cast(keys_in, work, "CAST_RINT", count)

    @T.macro
    def build_pair_offsets(q):
        """The byte offsets of each row's even codes, then of its odd ones, for the gather that
        pairs them (once a launch)."""
        if fp4:
            for r in T.serial(tile_rows):
                for j in T.serial(half):
                    q.pair_offsets[r, j] = T.Cast("uint32", (r * dim + 2 * j) * 4)
                    q.pair_offsets[tile_rows + r, j] = T.Cast("uint32", (r * dim + 2 * j + 1) * 4)

    @T.macro
    def e2m1_step(q, magnitudes, index):
        """Step ``index`` of :data:`E2M1_STEPS` over the tile's scaled magnitudes: 1 where taken,
        else 0, added to the codes and, times the step's value, to the decoded magnitudes."""
        T.tile.add(q.steps, magnitudes, -E2M1_STEPS[index][0])
        T.tile.mul(q.steps, q.steps, 2.0 ** 30)
        if E2M1_STEPS[index][1]:
            T.tile.add(q.steps, q.steps, 1.0)
        T.tile.max(q.steps, q.steps, 0.0)
        T.tile.min(q.steps, q.steps, 1.0)
        T.tile.axpy(q.codes, q.steps, 1.0)
        T.tile.axpy(q.decoded, q.steps, E2M1_STEPS[index][2])

    @T.macro
    def quantize_fp4(keys_in, work, squares, q):
        """The tile's keys (``work``, float32 of the rounded keys) to packed e2m1 codes and scale
        bytes in ``q.packed``, and what a reader decodes from them into ``keys_in``: per 32-value
        block the UE8M0 byte from the max's bits (:func:`mxfp4_scale_byte`), the keys times the
        reciprocal (exact), each magnitude's steps of :data:`E2M1_STEPS` as ``clamp((a - t) *
        2^30 [+ 1], 0, 1)`` (exactly 0 or 1: a magnitude differs from a threshold by at least
        2^-25), the sign from ``clamp(-key * 2^200, 0, 1)`` (so ``-0.0`` keeps code 0), and the
        codes paired by a gather, ``low + 16 * high``, cast through half to bytes."""
        block_scales(work, squares, q, q.packed)
        T.tile.abs(squares, work)
        e2m1_step(q, squares, 0)
        e2m1_step(q, squares, 1)
        e2m1_step(q, squares, 2)
        e2m1_step(q, squares, 3)
        e2m1_step(q, squares, 4)
        e2m1_step(q, squares, 5)
        e2m1_step(q, squares, 6)
        T.tile.mul(q.steps, work, -(2.0 ** 100))
        T.tile.mul(q.steps, q.steps, 2.0 ** 100)
        T.tile.max(q.steps, q.steps, 0.0)
        T.tile.min(q.steps, q.steps, 1.0)
        T.tile.axpy(q.codes, q.steps, 8.0)
        T.tile.mul(q.steps, q.steps, -2.0)
        T.tile.add(q.steps, q.steps, 1.0)
        T.tile.mul(q.decoded, q.decoded, q.steps)
        T.tile.row_expand_mul(q.decoded_blocks, q.decoded_blocks, q.block_max)
        T.tile.cast(keys_in, q.decoded, "CAST_RINT", count)
        T.tile.gather(q.pairs, q.codes, q.pair_offsets, 0)
        T.tile.bitwise_lshift(q.pair_offsets, q.pair_offsets, 2)
        T.tile.axpy(q.low_codes, q.high_codes, 16.0)
        T.tile.cast(q.byte_half, q.low_codes, "CAST_NONE", tile_rows * half)
        T.tile.cast(q.code_bytes, q.byte_half, "CAST_RINT", tile_rows * half)

    @T.macro
    def store_row(rows_in, slot, r, slot_row, cache, q):
        """Row ``r`` of the tile into cache row ``slot_row``: the e4m3 bytes and scale bytes, or the
        bf16 keys (``rows_in[slot]``)."""
        if fp4:
            T.copy(q.packed[r, :], cache[slot_row, 0:half])
            T.copy(q.packed[tile_rows + r, 0:per_row], cache[slot_row, half:INDEX_FP4_ROW_BYTES])
        elif quantized:
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
            q = T.meta_var(quant_views())
            with T.Scope("V"):
                T.copy(weight, weight_ub)
                build_offsets(swap_offsets, cos_offsets, sin_offsets, sign)
                build_pair_offsets(q)
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
                        if fp4:
                            T.tile.cast(work, rows_in[slot, :, :], "CAST_NONE", count)
                            quantize_fp4(rows_in[slot, :, :], work, squares, q)
                        elif quantized:
                            T.tile.cast(work, rows_in[slot, :, :], "CAST_NONE", count)
                            quantize_fp8(rows_in[slot, :, :], work, squares, q)
                        T.barrier_all()
                        for r in T.serial(tile_rows):
                            if slot_ub[r] >= 0:
                                store_row(rows_in, slot, r, slot_ub[r], cache, q)
                        T.copy(rows_in[slot, :, :], out[first:first + tile_rows, :])

    return kv_norm_rope_store
