"""Emulated ascend950 sparse MLA (decode and prefill): one block per query token and group of up
to 64 heads (one AI core's cube holds the group's queries), spread over the AI cores; the keys
(also the values) stream through in tiles of 64, each list (main, then extra) tiled on its own.
Per tile the cube computes the scores in float32, the vector cores keep the running max and sum
(online softmax) and rescale the float32 output accumulator in UB, and the cube adds the tile's
probabilities (in the queries' dtype, as the cube takes them) times its keys. The sink scales the
result, rounded once to the queries' dtype. Cache rows are decoded to the queries' dtype, which
holds FP8 and FP4 cache values exactly."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.mla import check_prefill_args, decode_keys, gather_keys
from deepinfer_backends.ascend950.buffers import AI_CORES, Buffer, layout
from deepinfer_backends.ascend950.emulate.apply_rope import GATHER_SCRATCH
from deepinfer_backends.ascend950.emulate.plan import BlockPlan, WriteRecord

HEAD_GROUP = 64
KEY_TILE = 64
D_SPLIT = 128
"""The cube takes the 512-wide head dim in four 128-deep steps."""


CACHE_ROW_BYTES = {"fp8": 528, "fp4": 288}
"""Bytes of one quantized cache row (:data:`deepinfer.hal.formats.TOKEN_FORMATS`), each staged
whole in UB by the vector core that decodes it."""
SCALE_GROUP = {"fp8": 32, "fp4": 16}
"""Values per scale of each quantized cache row (UE8M0 per 32, e4m3 per 16)."""


def buffers(dim: int, element: int, cache_formats: tuple[str, ...] = (), masked: bool = False) -> tuple[Buffer, ...]:
    """One block's buffers in layout order. L1: the group's queries, a double-buffered key tile
    and the tile's probabilities in the operand dtype. L0A/L0B: the 128-deep slices of queries
    and keys for the scores (double-buffered; the probabilities and a 128-wide key slice for
    their product reuse these slots, idle once the tile's scores are out). L0C: the scores
    (double-buffered) and a 128-wide slice of that product. UB, per vector core (half the
    group's heads): the float32 output accumulator, the scores as probabilities in float32 and
    in the operand dtype, a product slice, the running max, the previous max, the running sum,
    the tile's sum, the sink logits, the tile's key indices, one gathered key row, a rounded
    output slice and the row reduction's scratch. Each quantized format in ``cache_formats``
    (``fp8``, ``fp4``) the vector cores decode adds, before the scratch, the raw cache row
    (32-byte rounded), the row's values in float32 and its scales in float32; ``fp4`` also the
    row's codes in half, its nibble codes (then their values) and their signs in float32, the
    offsets of the gather that puts the values in order, and after the reduction's scratch the
    gather's; ``masked`` (padding indices allowed) adds the tile's logit bias. The native kernels,
    :mod:`~deepinfer_backends.ascend950.kernels.mla_sparse_decode` and
    :mod:`~deepinfer_backends.ascend950.kernels.mla_sparse_prefill`, place their buffers here."""
    g, k, d, half = HEAD_GROUP, KEY_TILE, D_SPLIT, HEAD_GROUP // 2
    unknown = [fmt for fmt in cache_formats if fmt not in CACHE_ROW_BYTES]
    if unknown:
        raise ValueError(f"cache formats {unknown}: the ascend950 MLA kernels decode {sorted(CACHE_ROW_BYTES)} rows")
    decode = tuple(buffer for fmt in cache_formats for buffer in (
        Buffer(f"{fmt}_row", "UB", -(-CACHE_ROW_BYTES[fmt] // 32) * 32),
        Buffer(f"{fmt}_values", "UB", dim * 4), Buffer(f"{fmt}_scales", "UB", dim // SCALE_GROUP[fmt] * 4),
        *((Buffer("fp4_half", "UB", dim), Buffer("fp4_pairs", "UB", dim * 4), Buffer("fp4_signs", "UB", dim * 4),
           Buffer("fp4_offsets", "UB", dim * 4)) if fmt == "fp4" else ())))
    return (Buffer("q_l1", "L1", g * dim * element), Buffer("k_l1", "L1", k * dim * element, copies=2),
            Buffer("p_l1", "L1", g * k * element),
            Buffer("q_l0", "L0A", g * d * element, copies=2), Buffer("k_l0", "L0B", k * d * element, copies=2),
            Buffer("scores", "L0C", g * k * 4, copies=2), Buffer("pv", "L0C", g * d * 4),
            Buffer("out_acc", "UB", half * dim * 4), Buffer("probs", "UB", half * k * 4),
            Buffer("probs_low", "UB", half * k * element), Buffer("pv_ub", "UB", half * d * 4),
            Buffer("row_max", "UB", half * 4), Buffer("prev_max", "UB", half * 4), Buffer("row_sum", "UB", half * 4),
            Buffer("tile_sum", "UB", half * 4), Buffer("sink", "UB", half * 4), Buffer("indices", "UB", k * 4),
            Buffer("key_row", "UB", dim * element), Buffer("out_low", "UB", half * d * element),
            *decode, *((Buffer("mask_bias", "UB", k * 4),) if masked else ()),
            Buffer("reduce_scratch", "UB", half * k * 2),
            *((Buffer("gather_scratch", "UB", GATHER_SCRATCH),) if "fp4" in cache_formats else ()))


def blocks(tokens: int, heads: int) -> int:
    """Blocks of one query token and up to :data:`HEAD_GROUP` heads, spread over the AI cores."""
    return tokens * -(-heads // HEAD_GROUP)


def key_tiles(main: int, total: int) -> list[tuple[int, int]]:
    """The key tiles ``[k0, k1)`` a block walks: the main list ``[0, main)``, then the extra list
    ``[main, total)``, each in tiles of :data:`KEY_TILE` from its own start (its last tile may be
    short)."""
    return [(k0, min(k0 + KEY_TILE, end)) for start, end in ((0, main), (main, total))
            for k0 in range(start, end, KEY_TILE)]


def padded_lists(main: int, total: int) -> tuple[int, int]:
    """``(main, total)`` once each list's short tile is filled up to :data:`KEY_TILE` with padding
    indices, as the kernels take them: the same tiles as :func:`key_tiles`, each whole."""
    whole = -(-main // KEY_TILE) * KEY_TILE
    return whole, whole + -(-(total - main) // KEY_TILE) * KEY_TILE


def mla_sparse_decode(q, cache, indices, sink, scale, cache_format="fp8", extra_cache=None, extra_indices=None,
                      extra_format="fp4", platform: str = "A5"):
    """:func:`deepinfer.hal.ops.mla.mla_sparse_decode` as the ascend950 kernel plans it."""
    keys, valid = decode_keys(q, cache, indices, sink, cache_format, extra_cache, extra_indices, extra_format)
    batch, s_q, heads, dim = q.shape
    formats = (cache_format,) + ((extra_format,) if extra_cache is not None else ())
    out, lse = attend(q.reshape(batch * s_q, heads, dim), keys, valid, sink, scale, indices.shape[-1], platform,
                      tuple(dict.fromkeys(fmt for fmt in formats if fmt in CACHE_ROW_BYTES)))
    return out.reshape(q.shape), lse.reshape(batch, s_q, heads)


def mla_sparse_prefill(q, kv, indices, sink, scale, main_keys=None, platform: str = "A5"):
    """:func:`deepinfer.hal.ops.mla.mla_sparse_prefill` as the ascend950 kernel plans it."""
    check_prefill_args(q, kv, indices, sink, main_keys)
    keys, valid = gather_keys(kv, indices)
    return attend(q, keys, valid, sink, scale, indices.shape[-1] if main_keys is None else main_keys, platform)


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float,
           main: int, platform: str = "A5", cache_formats: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, h, D]`` over ``keys float32 [N, K, D]`` (``valid [N, K]``), the first ``main``
    columns one list and the rest another: ``(out [N, h, D] in q.dtype, lse float32 [N, h])``;
    ``cache_formats``: the quantized formats the keys were decoded from (their buffers join the
    plan checked against the platform)."""
    tokens, heads, dim = q.shape
    operand = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    layout(buffers(dim, torch.finfo(operand).bits // 8, cache_formats, masked=True), platform)
    out = torch.zeros(tokens, heads, dim, dtype=q.dtype)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32)
    record = WriteRecord(tokens * heads, 1)
    plan = BlockPlan(AI_CORES[platform])
    groups = -(-heads // HEAD_GROUP)
    for block in range(blocks(tokens, heads)):
        n, h0 = block // groups, block % groups * HEAD_GROUP
        plan.add((n, h0, min(h0 + HEAD_GROUP, heads)))
    tiles = key_tiles(main, keys.shape[1])
    for core_blocks in plan.per_core():
        for n, h0, h1 in core_blocks:
            out[n, h0:h1], lse[n, h0:h1] = _block(q[n, h0:h1], keys[n], valid[n], sink[h0:h1], scale, tiles, operand)
            record.store(slice(n * heads + h0, n * heads + h1), slice(0, 1))
    record.check(tokens * heads)
    return out, lse


def _block(q, keys, valid, sink, scale, tiles, operand):
    group = q.shape[0]
    queries = q.to(operand)
    running_max = torch.full((group,), float("-inf"))
    running_sum = torch.zeros(group)
    acc = torch.zeros(group, q.shape[1])
    for k0, k1 in tiles:
        tile = keys[k0:k1].to(operand)
        scores = torch.zeros(group, k1 - k0)
        for d0 in range(0, q.shape[1], D_SPLIT):
            scores += queries[:, d0:d0 + D_SPLIT].float() @ tile[:, d0:d0 + D_SPLIT].float().T
        scores = (scale * scores).masked_fill(~valid[k0:k1], float("-inf"))
        new_max = torch.maximum(running_max, scores.max(dim=1).values)
        finite = torch.isfinite(new_max)
        shift = torch.where(finite, new_max, torch.zeros_like(new_max))
        probs = torch.exp(scores - shift[:, None]).masked_fill(~finite[:, None], 0.0)
        decay = torch.where(torch.isfinite(running_max), torch.exp(running_max - shift), torch.zeros_like(shift))
        running_sum = running_sum * decay + probs.sum(dim=1)
        acc = acc * decay[:, None] + probs.to(operand).float() @ tile.float()
        running_max = new_max
    seen = running_sum > 0
    lse = torch.where(seen, running_max + torch.log(running_sum), torch.full_like(running_sum, float("-inf")))
    out = torch.where(seen[:, None], acc / running_sum.clamp(min=1e-38)[:, None], torch.zeros_like(acc))
    return (out * torch.sigmoid(lse - sink.float())[:, None]).to(q.dtype), lse
