"""Sparse MLA decode on the ascend950 cube and vector cores, one block per query token and group
of ``head_group`` heads, block ``b`` on AI core ``b % cores``. Each block walks its token's
``topk`` key indices in tiles of ``key_tile``: the two vector cores gather half the tile's key
rows each (by index, through UB) into the core's GM key slot and flag the cube; the cube stages
the tile in L1 (double-buffered by tile parity), computes the scores in ``d_split``-deep steps
into L0C and hands them over through GM; each vector core keeps the running max and sum of its
half of the heads (online softmax), rescales its float32 output accumulator and returns the
probabilities in the operand dtype; the cube multiplies them by the keys (the values) one
``d_split``-wide slice at a time, its operands in the score operands' L0 slots, and hands each
slice back to be added. At the end each vector
core divides by the sum, scales by ``sigmoid(lse - sink)``, rounds once and stores its heads'
rows and ``lse``. A ``bf16`` cache's rows are the keys in the operand dtype. An ``fp8`` cache's
528-byte rows (512 e4m3 values, then 16 UE8M0 scales, one per 32, read as int16 pairs, low byte
first) are staged whole in UB; the vector core widens the values to float32, multiplies each
32-value group by its scale (bits ``e << 23`` through an int32 view) and rounds them to the
operand dtype, exactly, as :func:`deepinfer.hal.formats.decode_tokens` defines them. An ``fp4``
cache's 288-byte rows (512 e2m1 codes two a byte, the even value in the low nibble, then 32 e4m3
scales, one per 16) are staged the same way; with no e2m1 type the vector core widens the bytes
to float32 (through half), splits them into low and high nibbles (the high one by a floor cast
of ``byte / 16``), turns each code into its value in float32 arithmetic (``n = clamp(code - 7, 0,
1)``, ``m = code - 8n``, ``max(2m - 8, m - 2, m / 2) * (1 - 2n)``), puts the values back in row
order with a gather (evens from the low nibbles, odds from the high ones), multiplies each
16-value group by its scale (e4m3 widened to float32) and rounds them to the operand dtype,
exactly. With ``extra_format`` a second cache (the extra list's, ``fp8`` or ``fp4``) comes
after the first: key tiles before ``main_keys`` gather from the first cache, the rest from the
second. With
``masked``, a padding index (-1) gathers a zero row and adds a logit bias far below any score
(its probability is 0), and a query with no valid key gets ``out = 0``, ``lse = -inf``; without
it every index is valid. Buffers and their order: :func:`deepinfer_backends.ascend950.emulate.mla.buffers`."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects
import types

from .grouped_gemm_fp8 import ue8m0_bits

CACHE_ROW_BYTES = {"fp8": 528, "fp4": 288}
"""Bytes of a quantized cache row by format (512 values and their scales)."""
FP8_GROUP = 32
"""Values per UE8M0 scale of an ``fp8`` cache row."""
FP4_GROUP = 16
"""Values per e4m3 scale of an ``fp4`` cache row."""
MASKED_LOGIT = -3.0e38
"""The logit bias of a padding key: its exponential is 0 next to any real score."""


def mla_sparse_decode_kernel(tokens: int, heads: int, dim: int, topk: int, kv_rows: int, head_group: int,
                             key_tile: int, d_split: int, cores: int, scale: float, offsets: dict,
                             dtype: str = "bfloat16", cache_format: str = "bf16", masked: bool = False,
                             extra_format: str | None = None, extra_rows: int = 0, main_keys: int | None = None):
    """The tilelang-ascend ``prim_func`` of ``out, lse = attend(q [tokens, heads, dim], kv [kv_rows,
    ...] at indices [tokens, topk], sink [heads])``, ``kv`` the cache rows in ``cache_format``
    (``bf16``: ``dtype [kv_rows, dim]``; ``fp8``: ``uint8 [kv_rows, 528]``; ``fp4``: ``uint8
    [kv_rows, 288]``); ``masked``: indices may be -1 (padding); ``offsets``: each buffer's byte
    offset in its scope by plan name. With ``extra_format`` (``fp8`` or ``fp4``) a parameter
    ``extra uint8 [extra_rows, row bytes]`` follows ``kv``, and the indices from ``main_keys`` on (a
    multiple of ``key_tile``) are its rows."""
    for role, fmt in (("cache", cache_format), ("extra", extra_format)):
        if fmt is not None and fmt not in ("bf16", *CACHE_ROW_BYTES) or role == "extra" and fmt == "bf16":
            raise ValueError(f"mla_sparse_decode_kernel reads {'bf16 or ' if role == 'cache' else ''}"
                             f"{sorted(CACHE_ROW_BYTES)} {role} rows, not {fmt!r}")
    if (cache_format != "bf16" or extra_format is not None) and dim != 512:
        raise ValueError(f"a quantized cache row holds 512 values, not dim={dim}")
    main_keys = topk if extra_format is None else main_keys
    if main_keys is None or not 0 <= main_keys <= topk or main_keys % key_tile:
        raise ValueError(f"main_keys={main_keys} must be a multiple of key_tile={key_tile} within topk={topk}")
    if extra_format is not None and not masked:
        raise ValueError("two index lists are padded to whole tiles: masked must be set")
    for name, size, tile in (("heads", heads, head_group), ("topk", topk, key_tile), ("dim", dim, d_split)):
        if size % tile:
            raise ValueError(f"mla_sparse_decode_kernel takes whole tiles: {name}={size} is not a multiple of {tile}")
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    groups = heads // head_group
    blocks = tokens * groups
    rounds = -(-blocks // cores)
    tiles = topk // key_tile
    main_tiles = main_keys // key_tile
    steps = dim // d_split
    half = head_group // 2
    gathered = key_tile // 2
    accum = "float32"
    kv_shape, kv_dtype = ((kv_rows, CACHE_ROW_BYTES[cache_format]), "uint8") if cache_format != "bf16" \
        else ((kv_rows, dim), dtype)
    extra_shape = (extra_rows, CACHE_ROW_BYTES.get(extra_format, 1))
    formats = tuple(dict.fromkeys(fmt for fmt in (cache_format, extra_format) if fmt in CACHE_ROW_BYTES))
    nibbles = dim // 2

    def decode_buffers(fmt: str):
        """The UB buffers that decode a row of quantized format ``fmt``: the raw row and views of
        it (``fp8``: its values as e4m3, its scales as int16 pairs; ``fp4``: its codes as bytes,
        its scales as e4m3), the values in float32 (also as scale groups) and the scales in
        float32 (``fp8``: an int32 view for their bits); for ``fp4`` also the codes in half, the
        nibble codes (low ones, then high ones; later their signed values), the signs (first an
        int32 view for the floor cast) and the gather's offsets."""
        row_bytes, group = CACHE_ROW_BYTES[fmt], FP8_GROUP if fmt == "fp8" else FP4_GROUP
        views = dict(row=T.alloc_ub((1, -(-row_bytes // 32) * 32), "uint8"),
                     values=T.alloc_ub((dim // group, group), accum), scales=T.alloc_ub((dim // group,), accum))
        place = dict(row=offsets[f"{fmt}_row"], values=offsets[f"{fmt}_values"], scales=offsets[f"{fmt}_scales"])
        if fmt == "fp8":
            views.update(e4m3=T.alloc_ub((dim // group, group), "e4m3_float8"), packed=T.alloc_ub((1, 16), "int16"),
                         bits=T.alloc_ub((dim // group,), "int32"))
            place.update(e4m3=offsets["fp8_row"], packed=offsets["fp8_row"] + dim, bits=offsets["fp8_scales"])
        else:
            views.update(code_bytes=T.alloc_ub((1, nibbles), "uint8"), scale_e4m3=T.alloc_ub((1, dim // group),
                                                                                             "e4m3_float8"),
                         flat=T.alloc_ub((1, dim), accum), half=T.alloc_ub((1, nibbles), "float16"),
                         pairs=T.alloc_ub((1, dim), accum), low=T.alloc_ub((1, nibbles), accum),
                         high=T.alloc_ub((1, nibbles), accum), signs=T.alloc_ub((1, dim), accum),
                         floors=T.alloc_ub((1, nibbles), "int32"), offsets=T.alloc_ub((1, dim), "uint32"))
            place.update(code_bytes=offsets["fp4_row"], scale_e4m3=offsets["fp4_row"] + nibbles,
                         flat=offsets["fp4_values"], half=offsets["fp4_half"], pairs=offsets["fp4_pairs"],
                         low=offsets["fp4_pairs"], high=offsets["fp4_pairs"] + nibbles * 4,
                         signs=offsets["fp4_signs"], floors=offsets["fp4_signs"], offsets=offsets["fp4_offsets"])
        for name, buffer in views.items():
            IRBuilder.name(f"{fmt}_{name}", buffer)
        T.annotate_address({buffer: place[name] for name, buffer in views.items()})
        return types.SimpleNamespace(**views)

    def decoders():
        """The decode buffers of each quantized format read, by format."""
        return {fmt: decode_buffers(fmt) for fmt in formats}

    def mask_buffer():
        """The tile's logit bias (None unless ``masked``)."""
        if not masked:
            return None
        bias = T.alloc_ub((key_tile,), accum)
        IRBuilder.name("mask_bias", bias)
        T.annotate_address({bias: offsets["mask_bias"]})
        return bias

    @T.macro
    def build_fp4_offsets(dq):
        """The byte offsets that put an ``fp4`` row's values back in order: value ``2j`` from low
        nibble ``j``, value ``2j + 1`` from high nibble ``j`` (once a launch)."""
        if "fp4" in formats:
            for i in T.serial(dim):
                dq["fp4"].offsets[0, i] = T.Cast("uint32", (i % 2 * nibbles + i // 2) * 4)

    @T.macro
    def decode_fp4(d4, key_row):
        """The staged ``fp4`` row ``d4.row`` into ``key_row`` in the operand dtype (exact)."""
        T.tile.cast(d4.half, d4.code_bytes, "CAST_NONE", nibbles)
        T.tile.cast(d4.low, d4.half, "CAST_NONE", nibbles)
        T.tile.mul(d4.high, d4.low, 0.0625)
        T.tile.cast(d4.floors, d4.high, "CAST_FLOOR", nibbles)
        T.tile.cast(d4.high, d4.floors, "CAST_NONE", nibbles)
        T.tile.axpy(d4.low, d4.high, -16.0)
        T.tile.add(d4.signs, d4.pairs, -7.0)
        T.tile.max(d4.signs, d4.signs, 0.0)
        T.tile.min(d4.signs, d4.signs, 1.0)
        T.tile.axpy(d4.pairs, d4.signs, -8.0)
        T.tile.mul(d4.signs, d4.signs, -2.0)
        T.tile.add(d4.signs, d4.signs, 1.0)
        T.tile.mul(d4.flat, d4.pairs, 2.0)
        T.tile.add(d4.flat, d4.flat, -8.0)
        T.tile.add(d4.pairs, d4.pairs, -2.0)
        T.tile.max(d4.flat, d4.flat, d4.pairs)
        T.tile.mul(d4.pairs, d4.pairs, 0.5)
        T.tile.add(d4.pairs, d4.pairs, 1.0)
        T.tile.max(d4.flat, d4.flat, d4.pairs)
        T.tile.mul(d4.pairs, d4.flat, d4.signs)
        T.tile.gather(d4.flat, d4.pairs, d4.offsets, 0)
        T.tile.bitwise_lshift(d4.offsets, d4.offsets, 2)
        T.tile.cast(d4.scales, d4.scale_e4m3, "CAST_NONE", dim // FP4_GROUP)
        T.barrier_all()
        T.tile.row_expand_mul(d4.values, d4.values, d4.scales)
        T.tile.cast(key_row, d4.flat, "CAST_RINT", dim)

    @T.macro
    def gather_row(row, kv, key_row, dq, fmt):
        """Key row ``row`` of a ``fmt`` cache into ``key_row`` in the operand dtype."""
        if fmt == "fp8":
            T.copy(kv[row, :], dq["fp8"].row[0, 0:CACHE_ROW_BYTES["fp8"]])
            T.barrier_all()
            for g in T.serial(dim // FP8_GROUP):
                dq["fp8"].bits[g] = ue8m0_bits(T, dq["fp8"].packed, 0, g)
            T.tile.cast(dq["fp8"].values, dq["fp8"].e4m3, "CAST_NONE", dim)
            T.barrier_all()
            T.tile.row_expand_mul(dq["fp8"].values, dq["fp8"].values, dq["fp8"].scales)
            T.tile.cast(key_row, dq["fp8"].values, "CAST_RINT", dim)
        elif fmt == "fp4":
            T.copy(kv[row, :], dq["fp4"].row[0, 0:CACHE_ROW_BYTES["fp4"]])
            T.barrier_all()
            decode_fp4(dq["fp4"], key_row)
        else:
            T.copy(kv[row, :], key_row)

    @T.macro
    def gather_key(index, t, kv, extra, key_row, dq):
        """The key row at ``index`` (tile ``t``'s list: the first cache's before ``main_tiles``,
        the extra cache's after) into ``key_row``; a padding index (-1) gives a zero row."""
        if masked:
            if index >= 0:
                if extra_format is None:
                    gather_row(index, kv, key_row, dq, cache_format)
                else:
                    if t < main_tiles:
                        gather_row(index, kv, key_row, dq, cache_format)
                    else:
                        gather_row(index, extra, key_row, dq, extra_format)
            else:
                T.tile.fill(key_row, 0.0)
        else:
            gather_row(index, kv, key_row, dq, cache_format)

    @T.macro
    def attend(q, kv, extra, indices, sink, keys_ws, scores_ws, probs_ws, pv_ws, out, lse, core, sub):
        q_l1 = T.alloc_L1((head_group, dim), dtype)
        k_l1 = T.alloc_L1((2, key_tile, dim), dtype)
        p_l1 = T.alloc_L1((head_group, key_tile), dtype)
        q_l0 = T.alloc_L0A((2, head_group, d_split), dtype)
        p_l0 = T.alloc_L0A((head_group, key_tile), dtype)
        k_l0 = T.alloc_L0B((2, d_split, key_tile), dtype)
        v_l0 = T.alloc_L0B((key_tile, d_split), dtype)
        scores = T.alloc_L0C((2, head_group, key_tile), accum)
        pv = T.alloc_L0C((head_group, d_split), accum)
        out_acc = T.alloc_ub((steps, half, d_split), accum)
        probs = T.alloc_ub((half, key_tile), accum)
        probs_low = T.alloc_ub((half, key_tile), dtype)
        pv_ub = T.alloc_ub((half, d_split), accum)
        row_max = T.alloc_ub((half,), accum)
        prev_max = T.alloc_ub((half,), accum)
        row_sum = T.alloc_ub((half,), accum)
        tile_sum = T.alloc_ub((half,), accum)
        sink_ub = T.alloc_ub((half,), accum)
        index_ub = T.alloc_ub((key_tile,), "int32")
        key_row = T.alloc_ub((1, dim), dtype)
        out_low = T.alloc_ub((half, d_split), dtype)
        dq = T.meta_var(decoders())
        mask_bias = T.meta_var(mask_buffer())
        T.annotate_address({q_l1: offsets["q_l1"], k_l1: offsets["k_l1"], p_l1: offsets["p_l1"],
                            q_l0: offsets["q_l0"], p_l0: offsets["q_l0"], k_l0: offsets["k_l0"],
                            v_l0: offsets["k_l0"], scores: offsets["scores"], pv: offsets["pv"],
                            out_acc: offsets["out_acc"], probs: offsets["probs"], probs_low: offsets["probs_low"],
                            pv_ub: offsets["pv_ub"], row_max: offsets["row_max"], prev_max: offsets["prev_max"],
                            row_sum: offsets["row_sum"], tile_sum: offsets["tile_sum"], sink_ub: offsets["sink"],
                            index_ub: offsets["indices"], key_row: offsets["key_row"],
                            out_low: offsets["out_low"]})
        with T.Scope("C"):
            for step in T.serial(rounds):
                block = step * cores + core
                if block < blocks:
                    token = block // groups
                    h0 = block % groups * head_group
                    T.copy(q[token, h0:h0 + head_group, :], q_l1)
                    for t in T.serial(tiles):
                        T.wait_cross_flag(0)
                        T.copy(keys_ws[core, :, :], k_l1[t % 2, :, :])
                        T.barrier_all()
                        for d in T.serial(steps):
                            T.copy(q_l1[:, d * d_split:(d + 1) * d_split], q_l0[d % 2, :, :])
                            T.copy(k_l1[t % 2, :, d * d_split:(d + 1) * d_split], k_l0[d % 2, :, :],
                                   transpose=True)
                            T.barrier_all()
                            T.mma(q_l0[d % 2, :, :], k_l0[d % 2, :, :], scores[t % 2, :, :], init=(d == 0))
                            T.barrier_all()
                        T.copy(scores[t % 2, :, :], scores_ws[core, :, :])
                        T.set_cross_flag("FIX", 1)
                        T.wait_cross_flag(2)
                        T.copy(probs_ws[core, :, :], p_l1)
                        T.barrier_all()
                        T.copy(p_l1, p_l0)
                        for d in T.serial(steps):
                            T.copy(k_l1[t % 2, :, d * d_split:(d + 1) * d_split], v_l0)
                            T.barrier_all()
                            T.mma(p_l0, v_l0, pv, init=True)
                            T.barrier_all()
                            T.copy(pv, pv_ws[core, :, d * d_split:(d + 1) * d_split])
                            T.barrier_all()
                        T.set_cross_flag("FIX", 3)
                        T.wait_cross_flag(4)
        with T.Scope("V"):
            build_fp4_offsets(dq)
            for step in T.serial(rounds):
                block = step * cores + core
                if block < blocks:
                    token = block // groups
                    h0 = block % groups * head_group + sub * half
                    T.tile.fill(out_acc, 0.0)
                    T.tile.fill(row_sum, 0.0)
                    T.tile.fill(row_max, -2.0 ** 30)
                    T.copy(sink[h0:h0 + half], sink_ub)
                    for t in T.serial(tiles):
                        T.copy(indices[token, t * key_tile:(t + 1) * key_tile], index_ub)
                        T.barrier_all()
                        for j in T.serial(gathered):
                            gather_key(index_ub[sub * gathered + j], t, kv, extra, key_row, dq)
                            T.barrier_all()
                            T.copy(key_row, keys_ws[core, sub * gathered + j, :])
                            T.barrier_all()
                        if masked:
                            for c in T.serial(key_tile):
                                if index_ub[c] >= 0:
                                    mask_bias[c] = T.float32(0.0)
                                else:
                                    mask_bias[c] = T.float32(MASKED_LOGIT)
                        T.set_cross_flag("MTE3", 0)
                        T.wait_cross_flag(1)
                        T.copy(scores_ws[core, sub * half:(sub + 1) * half, :], probs)
                        T.barrier_all()
                        T.tile.mul(probs, probs, scale)
                        if masked:
                            for r in T.serial(half):
                                T.tile.add(probs[r, :], probs[r, :], mask_bias)
                        T.copy(row_max, prev_max)
                        T.reduce_max(probs, tile_sum, dim=-1)
                        T.tile.max(row_max, row_max, tile_sum)
                        T.tile.sub(prev_max, prev_max, row_max)
                        T.tile.exp(prev_max, prev_max)
                        for r in T.serial(half):
                            T.tile.sub(probs[r, :], probs[r, :], row_max[r])
                        T.tile.exp(probs, probs)
                        T.reduce_sum(probs, tile_sum, dim=-1)
                        T.tile.mul(row_sum, row_sum, prev_max)
                        T.tile.add(row_sum, row_sum, tile_sum)
                        for d in T.serial(steps):
                            T.tile.row_expand_mul(out_acc[d, :, :], out_acc[d, :, :], prev_max)
                        T.tile.cast(probs_low, probs, "CAST_RINT", half * key_tile)
                        T.barrier_all()
                        T.copy(probs_low, probs_ws[core, sub * half:(sub + 1) * half, :])
                        T.set_cross_flag("MTE3", 2)
                        T.wait_cross_flag(3)
                        for d in T.serial(steps):
                            T.copy(pv_ws[core, sub * half:(sub + 1) * half, d * d_split:(d + 1) * d_split], pv_ub)
                            T.barrier_all()
                            T.tile.add(out_acc[d, :, :], out_acc[d, :, :], pv_ub)
                            T.barrier_all()
                        T.set_cross_flag("V", 4)
                    T.tile.ln(tile_sum, row_sum)
                    T.tile.add(row_max, row_max, tile_sum)
                    T.copy(row_max, lse[token, h0:h0 + half])
                    T.tile.sub(prev_max, row_max, sink_ub)
                    T.tile.sigmoid(prev_max, prev_max)
                    if masked:
                        T.tile.max(row_sum, row_sum, 1e-38)
                    T.tile.div(prev_max, prev_max, row_sum)
                    for d in T.serial(steps):
                        T.tile.row_expand_mul(out_acc[d, :, :], out_acc[d, :, :], prev_max)
                        T.tile.cast(out_low, out_acc[d, :, :], "CAST_RINT", half * d_split)
                        T.barrier_all()
                        T.copy(out_low, out[token, h0:h0 + half, d * d_split:(d + 1) * d_split])
                        T.barrier_all()

    if extra_format is None:
        @T.prim_func
        def mla_sparse_decode(q: T.Tensor((tokens, heads, dim), dtype), kv: T.Tensor(kv_shape, kv_dtype),
                              indices: T.Tensor((tokens, topk), "int32"), sink: T.Tensor((heads,), accum),
                              keys_ws: T.Tensor((cores, key_tile, dim), dtype),
                              scores_ws: T.Tensor((cores, head_group, key_tile), accum),
                              probs_ws: T.Tensor((cores, head_group, key_tile), dtype),
                              pv_ws: T.Tensor((cores, head_group, dim), accum),
                              out: T.Tensor((tokens, heads, dim), dtype), lse: T.Tensor((tokens, heads), accum)):
            with T.Kernel(cores, is_npu=True) as (core, sub):
                attend(q, kv, kv, indices, sink, keys_ws, scores_ws, probs_ws, pv_ws, out, lse, core, sub)
    else:
        @T.prim_func
        def mla_sparse_decode(q: T.Tensor((tokens, heads, dim), dtype), kv: T.Tensor(kv_shape, kv_dtype),
                              extra: T.Tensor(extra_shape, "uint8"), indices: T.Tensor((tokens, topk), "int32"),
                              sink: T.Tensor((heads,), accum), keys_ws: T.Tensor((cores, key_tile, dim), dtype),
                              scores_ws: T.Tensor((cores, head_group, key_tile), accum),
                              probs_ws: T.Tensor((cores, head_group, key_tile), dtype),
                              pv_ws: T.Tensor((cores, head_group, dim), accum),
                              out: T.Tensor((tokens, heads, dim), dtype), lse: T.Tensor((tokens, heads), accum)):
            with T.Kernel(cores, is_npu=True) as (core, sub):
                attend(q, kv, extra, indices, sink, keys_ws, scores_ws, probs_ws, pv_ws, out, lse, core, sub)
    return mla_sparse_decode
