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

``index_fp4`` and ``fp4``: rows of e2m1 codes packed two a byte (the even value in the low nibble),
then the scale bytes: for ``index_fp4`` 68 bytes (128 values, one UE8M0 byte per 32), the scale
byte from the block max (at least ``MXFP4_AMAX_FLOOR``) as for ``fp8`` (:func:`mxfp4_scale_byte`)
with an exact reciprocal; for ``fp4`` 288 bytes (512 values, one e4m3 scale per 16): the block max
(at least ``NVFP4_AMAX_FLOOR``) times ``1/6`` (the float32 constant, written as its bits: the
lowering prints float constants to seven digits), at most 448, cast to e4m3, whose bytes are the
scale bytes and whose values' reciprocals come from their bits (:func:`e4m3_reciprocal_bits`,
the correctly rounded ``1 / scale``), so the keys times it are rounded products as the format's
are. tilelang-ascend has no e2m1 type, so the scaled keys are rounded to e2m1 in float32
arithmetic: the sign first, ``8 * clamp(-key * 2^100 * 2^100, 0, 1)`` into the codes (a
``-0.0`` key keeps code 0, which decodes to the same zero), then over the magnitudes each step
of :data:`E2M1_STEPS`, ``clamp((|v| - t) * 2^30 [+ 1], 0, 1)``, exactly 0 or 1, added to the code.
A gather pairs the codes (evens, then odds), ``low + 16 * high`` goes through half to bytes;
``out`` is the codes decoded in float32 (the magnitude code ``m`` to ``max(m / 2, m - 2, 2m - 8)``,
signed) times the scale. The large constants need only be large: the lowering prints ``2^30`` as
``1.073742e+09``.

Buffers, in the plan's order
(:func:`deepinfer_backends.ascend950.emulate.kv_norm_rope_store.plan_buffers`); the quantizing
stores read some through views placed at the same address (the squares tile and the working
tile as scale blocks, the maxima and reciprocals as int32 bits; for ``fp8`` the squares tile as
e4m3 values and as bytes; for the FP4 formats the squares tile as the rounding's steps and as
the packed codes in half precision, the working tile as the paired codes, the codes tile as
blocks of decoded values, the packed bytes' data rows, and for ``fp4`` its scale rows as e4m3).
The lowering folds a buffer first written after another's last use into that one's storage,
whatever the planned offsets, so the rotation's buffers and the views are cleared at the start
of each tile, before any buffer's last use."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects
import struct
import types

from .apply_rope import rope_macros
from .mla_sparse_decode import CACHE_ROW_BYTES, FP8_GROUP

BF16_FORMATS = ("bf16", "index_bf16")
FP8_ROW_BYTES = CACHE_ROW_BYTES["fp8"]
FP4_ROW_BYTES = {"index_fp4": 68, "fp4": 288}
"""An FP4 format's row: packed e2m1 codes (128 or 512 values), then the scale bytes (4 UE8M0 or 32
e4m3)."""
FP4_GROUP = {"index_fp4": 32, "fp4": 16}
"""Values per scale byte in each FP4 format."""
E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
"""e2m1's rounding of a magnitude, nearest with ties to the even code, as steps: ``(threshold,
whether a magnitude equal to it steps up)``; the magnitude code is the number of steps taken."""
SIXTH_BITS = struct.unpack("<i", struct.pack("<f", 1 / 6))[0]
"""The float32 bits of ``1/6``, the factor from a block max to its e4m3 scale."""
E4M3_RECIPROCAL_BITS = tuple(struct.unpack("<i", struct.pack("<f", 1 / (1 + i / 8)))[0] for i in range(8))
"""The float32 bits of ``1 / m`` (correctly rounded) for each e4m3 mantissa ``m = 1 + i/8``."""


def e4m3_reciprocal_bits(bits, shift_right, as_int):
    """float32 bits of the correctly rounded ``1 / s`` from the float32 bits of an e4m3 value ``s``
    (positive, from ``2^-9`` to 448: a normal float32 whose mantissa has three bits), by TIR's or
    torch's ``shift_right`` and ``as_int`` (a comparison as 0 or 1): with ``s = m * 2^E``, ``1 / s``
    is ``1 / m`` (one of :data:`E4M3_RECIPROCAL_BITS`, picked by a sum of products, which lowers
    to one expression) times ``2^-E``, which keeps its rounding and stays a normal float32."""
    index = shift_right(bits, 20) & 7
    mantissa = sum(as_int(index == i) * E4M3_RECIPROCAL_BITS[i] for i in range(8))
    return mantissa - (shift_right(bits, 23) - 127) * (1 << 23)


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
    ``fp8``, ``[cache_rows, 68]`` for ``index_fp4``, ``[cache_rows, 288]`` for ``fp4``), and
    returning the decoded keys in ``out``; ``rows`` a multiple of ``tile_rows``; ``offsets``: each
    UB buffer's byte offset by its plan name; ``amax_floor``: the least block max a scale is taken
    from (:data:`deepinfer.hal.formats.FP8_AMAX_FLOOR` for ``fp8``, ``MXFP4_AMAX_FLOOR`` for
    ``index_fp4``, ``NVFP4_AMAX_FLOOR`` for ``fp4``; the quantized formats only)."""
    if fmt not in (*BF16_FORMATS, "fp8", *FP4_ROW_BYTES):
        raise ValueError(f"kv_norm_rope_store_kernel stores formats {[*BF16_FORMATS, 'fp8', *FP4_ROW_BYTES]}, "
                         f"got {fmt!r}")
    if dtype != "bfloat16":
        raise ValueError(f"kv_norm_rope_store_kernel takes bfloat16 rows, got {dtype}")
    if rows % tile_rows:
        raise ValueError(f"kv_norm_rope_store_kernel takes whole tiles: rows={rows} is not a multiple of "
                         f"tile_rows={tile_rows}")
    if vector_cores % 2:
        raise ValueError(f"vector_cores={vector_cores}: an AI core pairs two vector cores")
    fp4 = fmt in FP4_ROW_BYTES
    e4m3_scales = fmt == "fp4"
    quantized = fmt == "fp8" or fp4
    group = FP4_GROUP[fmt] if fp4 else FP8_GROUP
    row_bytes = FP4_ROW_BYTES[fmt] if fp4 else FP8_ROW_BYTES
    if quantized and dim * (1 if fmt == "fp8" else 0.5) + dim // group != row_bytes:
        raise ValueError(f"an {fmt} cache row holds {128 if fmt == 'index_fp4' else 512} values, not dim={dim}")
    if quantized and amax_floor is None:
        raise ValueError(f"an {fmt} store takes amax_floor, the least block max a scale is taken from")
    tiles = rows // tile_rows
    rounds = -(-tiles // vector_cores)
    count = tile_rows * dim
    blocks = count // group
    per_row = dim // group
    half = dim // 2
    cache_shape, cache_dtype = ((cache_rows, row_bytes), "uint8") if quantized else ((cache_rows, dim), dtype)
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    build_offsets, rotate, restore_offsets = rope_macros(T, tile_rows, rope_dim, False)

    def quant_views():
        """The quantizing stores' buffers (None for the bf16 formats): the block maxima and the
        reciprocals, and views at their addresses: the squares tile and the working tile as
        scale blocks, the maxima and reciprocals as int32; for ``fp8`` the squares tile as e4m3
        values and as bytes; for the FP4 formats the codes, the gather's offsets and the packed
        bytes of the plan, the squares tile as the rounding's steps and as the packed codes in
        half precision, the working tile as the paired codes (evens, then odds), the codes as
        blocks of decoded values, the packed bytes' data rows, and for ``fp4`` its scale rows as
        e4m3 values and as bytes."""
        if not quantized:
            return None
        views = dict(block_max=T.alloc_ub((blocks,), "float32"), recip=T.alloc_ub((blocks,), "float32"),
                     max_bits=T.alloc_ub((blocks,), "int32"), recip_bits=T.alloc_ub((blocks,), "int32"),
                     magnitudes=T.alloc_ub((blocks, group), "float32"),
                     work_blocks=T.alloc_ub((blocks, group), "float32"))
        place = dict(block_max="block_max", recip="recip", max_bits="block_max", recip_bits="recip",
                     magnitudes="squares", work_blocks="work")
        if fp4:
            views.update(steps=T.alloc_ub((tile_rows, dim), "float32"), codes=T.alloc_ub((tile_rows, dim), "float32"),
                         decoded_blocks=T.alloc_ub((blocks, group), "float32"),
                         pairs=T.alloc_ub((2 * tile_rows, half), "float32"),
                         low_codes=T.alloc_ub((tile_rows, half), "float32"),
                         high_codes=T.alloc_ub((tile_rows, half), "float32"),
                         pair_offsets=T.alloc_ub((2 * tile_rows, half), "uint32"),
                         byte_half=T.alloc_ub((tile_rows, half), "float16"),
                         packed=T.alloc_ub((2 * tile_rows, half), "uint8"),
                         code_bytes=T.alloc_ub((tile_rows, half), "uint8"))
            place.update(steps="squares", codes="codes", decoded_blocks="codes", pairs="work", low_codes="work",
                         high_codes=("work", tile_rows * half * 4), pair_offsets="pair_offsets",
                         byte_half="squares", packed="packed", code_bytes="packed")
            if e4m3_scales:
                views.update(scale_codes=T.alloc_ub((blocks,), "e4m3_float8"),
                             scale_rows=T.alloc_ub((tile_rows, per_row), "uint8"))
                place.update(scale_codes=("packed", tile_rows * half), scale_rows=("packed", tile_rows * half))
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
                if e4m3_scales:
                    T.tile.fill(q.scale_rows, 0)
                    T.tile.fill(q.scale_codes, 0.0)
                T.tile.fill(q.byte_half, 0.0)
                T.tile.fill(q.pairs, 0.0)
                T.tile.fill(q.low_codes, 0.0)
                T.tile.fill(q.high_codes, 0.0)
                T.tile.fill(q.decoded_blocks, 0.0)
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
        """Each scale block's max (at least the floor) to its scale byte and the scale's and
        reciprocal's bits into the maxima and reciprocals, then the keys in ``work`` times their
        reciprocal. UE8M0 (``fp8``, ``index_fp4``): the byte from the max's bits
        (:func:`scale_byte`, at row ``tile_rows + r`` of ``scale_bytes``), the reciprocal exact.
        e4m3 (``fp4``): the max times ``1/6`` (its bits written through the reciprocals' first
        element), at most 448, cast to e4m3 (the scale rows) and back, the reciprocal from the
        scale's bits (:func:`e4m3_reciprocal_bits`), the products rounded."""
        T.tile.abs(squares, work)
        T.reduce_max(q.magnitudes, q.block_max, dim=-1)
        T.tile.max(q.block_max, q.block_max, amax_floor)
        if e4m3_scales:
            q.recip_bits[0] = SIXTH_BITS
            T.barrier_all()
            T.tile.mul(q.block_max, q.block_max, q.recip[0])
            T.tile.min(q.block_max, q.block_max, 448.0)
            T.tile.cast(q.scale_codes, q.block_max, "CAST_RINT", blocks)
            T.tile.cast(q.block_max, q.scale_codes, "CAST_NONE", blocks)
            T.barrier_all()
            for b in T.serial(blocks):
                q.recip_bits[b] = e4m3_reciprocal_bits(q.max_bits[b], T.shift_right, lambda c: T.Cast("int32", c))
        else:
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
        else 0, added to the codes."""
        T.tile.add(q.steps, magnitudes, -E2M1_STEPS[index][0])
        T.tile.mul(q.steps, q.steps, 2.0 ** 30)
        if E2M1_STEPS[index][1]:
            T.tile.add(q.steps, q.steps, 1.0)
        T.tile.max(q.steps, q.steps, 0.0)
        T.tile.min(q.steps, q.steps, 1.0)
        T.tile.axpy(q.codes, q.steps, 1.0)

    @T.macro
    def quantize_fp4(keys_in, work, squares, q):
        """The tile's keys (``work``, float32 of the rounded keys) to packed e2m1 codes and scale
        bytes in ``q.packed``, and what a reader decodes from them into ``keys_in``:
        :func:`block_scales`, the sign into the codes (``8 * clamp(-key * 2^200, 0, 1)``, so
        ``-0.0`` keeps code 0), the magnitudes in place of the keys, each magnitude's steps of
        :data:`E2M1_STEPS` as ``clamp((a - t) * 2^30 [+ 1], 0, 1)`` (exactly 0 or 1: a magnitude
        differs from a threshold by at least 2^-26), the codes paired by a gather, ``low + 16 *
        high`` cast through half to bytes; then, in the freed working and squares tiles, the
        codes decoded: ``n = clamp(code - 7, 0, 1)`` (negative), ``m = code - 8n``, ``max(2m - 8,
        m - 2, m / 2)`` (0, 0.5, 1, 1.5, 2, 3, 4, 6) times ``1 - 2n`` and the scale."""
        block_scales(work, squares, q, q.packed)
        T.tile.mul(q.codes, work, -(2.0 ** 100))
        T.tile.mul(q.codes, q.codes, 2.0 ** 100)
        T.tile.max(q.codes, q.codes, 0.0)
        T.tile.min(q.codes, q.codes, 1.0)
        T.tile.mul(q.codes, q.codes, 8.0)
        T.tile.abs(work, work)
        e2m1_step(q, work, 0)
        e2m1_step(q, work, 1)
        e2m1_step(q, work, 2)
        e2m1_step(q, work, 3)
        e2m1_step(q, work, 4)
        e2m1_step(q, work, 5)
        e2m1_step(q, work, 6)
        T.tile.gather(q.pairs, q.codes, q.pair_offsets, 0)
        T.tile.bitwise_lshift(q.pair_offsets, q.pair_offsets, 2)
        T.tile.axpy(q.low_codes, q.high_codes, 16.0)
        T.tile.cast(q.byte_half, q.low_codes, "CAST_NONE", tile_rows * half)
        T.tile.cast(q.code_bytes, q.byte_half, "CAST_RINT", tile_rows * half)
        T.tile.add(work, q.codes, -7.0)
        T.tile.max(work, work, 0.0)
        T.tile.min(work, work, 1.0)
        T.tile.mul(squares, work, -8.0)
        T.tile.add(squares, squares, q.codes)
        T.tile.mul(work, work, -2.0)
        T.tile.add(work, work, 1.0)
        T.tile.mul(q.codes, squares, 2.0)
        T.tile.add(q.codes, q.codes, -8.0)
        T.tile.add(squares, squares, -2.0)
        T.tile.max(q.codes, q.codes, squares)
        T.tile.mul(squares, squares, 0.5)
        T.tile.add(squares, squares, 1.0)
        T.tile.max(q.codes, q.codes, squares)
        T.tile.mul(q.codes, q.codes, work)
        T.tile.row_expand_mul(q.decoded_blocks, q.decoded_blocks, q.block_max)
        T.tile.cast(keys_in, q.codes, "CAST_RINT", count)

    @T.macro
    def store_row(rows_in, slot, r, slot_row, cache, q):
        """Row ``r`` of the tile into cache row ``slot_row``: the codes and scale bytes, or the bf16
        keys (``rows_in[slot]``)."""
        if e4m3_scales:
            T.copy(q.packed[r, :], cache[slot_row, 0:half])
            T.copy(q.scale_rows[r, :], cache[slot_row, half:row_bytes])
        elif fp4:
            T.copy(q.packed[r, :], cache[slot_row, 0:half])
            T.copy(q.packed[tile_rows + r, 0:per_row], cache[slot_row, half:row_bytes])
        elif quantized:
            T.copy(q.code_bytes[r, :], cache[slot_row, 0:dim])
            T.copy(q.code_bytes[tile_rows + r, 0:per_row], cache[slot_row, dim:row_bytes])
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
