"""Batch-invariant versions of the reference ops (``engine.batch_invariant=true``).

Measured with ``experiments/batch_invariance_probe.py``: on a CPU (MKL) a GEMM changes its
blocking with the row count (one row gives one result at M=1, another at M=2-3, a third at
M>=4), and some vectorized functions (softplus, sigmoid, silu, exp2) compute a tensor's tail on
a scalar path that rounds differently, so a row's result also depends on where it lands; on an
H200 the GEMMs, the attention and the indexer change with the batch as well. All of it vanishes
when every kernel sees the same shapes: the ops here run their reference on tiles of exactly
:func:`row_tile` rows (32 on a CPU, 256 on an accelerator; the last tile padded by repeating
its last row), each copied into a fresh contiguous buffer, so the kernel, its blocking, its tail
and its memory alignment are the same whatever else is in the batch. Key columns whose count depends on the batch (the indexer's
compressed keys) are tiled the same way by :data:`KEY_TILE`. Attention runs token by token in
the same tile shape for prefill and decode, so a token's output does not depend on the path.

The remaining ops are batch-invariant as written; :data:`INVARIANT_AS_IS` says why.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops import all_to_all, indexer, mla, routing
from deepinfer.hal.ops.activation import swiglu
from deepinfer.hal.ops.grouped_gemm import check_grouped_gemm, check_grouped_out_dtype, grouped_gemm_tiled, linear
from deepinfer.hal.ops.grouped_swiglu import check_grouped_swiglu
from deepinfer.hal.spec import SPECS

ROW_TILE = 32
"""Rows per kernel call on a CPU. A multiple of 32, so a tile of any row width never leaves a
vector tail."""
ACCELERATOR_ROW_TILE = 256
"""Rows per kernel call on an accelerator, where a call costs a launch and padded rows are
nearly free: a decode batch with DSpark drafts (up to 256 rows) is one tile."""
KEY_TILE = 128
"""Indexer key columns per kernel call."""

ROW_TILED = {
    "linear": ("x",),
    "stacked_linear": ("x", "positions"),
    "grouped_linear": ("x", "positions"),
    "rms_norm": ("x", "residual"),
    "kv_norm_rope_store": ("x", "positions", "slots"),
    "mhc_mixes": ("residual",),
    "mhc_pre": ("residual", "pre"),
    "mhc_post": ("y", "residual", "post", "comb"),
    "mhc_post_pre": ("y", "residual", "post", "comb", "pre"),
    "mhc_head": ("residual",),
    "engram_gate": ("residual", "kv"),
    "moe_gate": ("logits",),
    "sample": ("logits", "temperature", "top_p", "top_k", "seeds", "positions"),
    "speculative_accept": ("target_logprobs", "draft_logprobs", "draft_ids", "seeds", "positions"),
}
"""Ops run on row tiles of their reference: op -> its row-aligned arguments (dim 0). A padded tile
of ``kv_norm_rope_store`` repeats its last row with that row's slot, so it only stores the same
bytes at the same slot again."""

INVARIANT_AS_IS = {
    "apply_rope": "per element: products and sums with the token's table row",
    "swiglu": "per element",
    "compress_tokens": "per (token, channel): softmax-weighted sum over the ratio members, in member order; "
                       "V4.1's ratios (1, 2) leave no order to choose",
    "kv_store": "per token: block max, power-of-two scale and rounding are exact",
    "kv_load": "per token: exact decode",
    "kv_cast": "per token: exact encode and decode",
    "quantize_activations": "per 32 values of a row: block max, power-of-two scale and rounding are exact",
    "indexer_topk": "per row: comparisons only (stable sort, ties to the lower column)",
    "candidate_blocks": "per row: block maxima and comparisons only (stable sort, ties to the lower block)",
    "ep_dispatch": "a permutation of rows",
    "ep_combine": "per token: the routed slots are summed in slot order",
    "swa_ring_slots": "integer addressing",
    "engram_hash": "per token: integer products, XOR and remainders",
    "compressed_decode_layout": "integer addressing",
    "swa_decode_indices": "integer addressing",
    "swa_prefill_indices": "integer addressing",
    "swa_history_slots": "integer addressing",
    "apply_token_bitmask": "per element: adds 0.0 or -inf",
}
"""Ops whose reference already fixes each row's arithmetic, with the reason."""

Rows = torch.Tensor | Quantized


def row_tile(device: torch.device) -> int:
    """The fixed tile height on ``device`` (never a function of the batch)."""
    return ROW_TILE if device.type == "cpu" else ACCELERATOR_ROW_TILE


def row_tiled(reference: Callable, rows: tuple[str, ...]) -> Callable:
    """``reference`` run on :func:`row_tile`-row tiles of its ``rows`` arguments, outputs joined.

    Outputs (a tensor or a tuple of tensors) must be row-aligned with the inputs. Calls with no
    rows or malformed row arguments go to ``reference`` unchanged (it answers or refuses)."""
    names = list(inspect.signature(reference).parameters)

    @functools.wraps(reference)
    def tiled(*args, **kwargs):
        arguments = {**dict(zip(names, args)), **kwargs}
        count = _row_count([arguments.get(name) for name in rows])
        if not count:
            return reference(*args, **kwargs)
        outputs, size = [], row_tile(_device(next(arguments[n] for n in rows if arguments.get(n) is not None)))
        for start in range(0, count, size):
            tile = dict(arguments)
            for name in rows:
                if arguments.get(name) is not None:
                    tile[name] = _tile(arguments[name], start, size)
            outputs.append(reference(**tile))
        return _join(outputs, count)

    return tiled


_linear = row_tiled(linear, ROW_TILED["linear"])
_attention = row_tiled(mla.sparse_attention, ("q", "keys", "valid"))
_indexer_rows = row_tiled(indexer.indexer_logits, ("q", "weights"))


def grouped_gemm(x: Rows, weight: Rows, group_sizes: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`~deepinfer.hal.ops.grouped_gemm.grouped_gemm` on tiles of exactly :func:`row_tile`
    rows, each starting at its expert's segment start plus a multiple of the tile."""
    check_grouped_gemm(x, weight, group_sizes)
    out_dtype = check_grouped_out_dtype(x, weight, out_dtype)
    return grouped_gemm_tiled(x, weight, group_sizes, row_tile(_device(x)), linear).to(out_dtype)


def grouped_swiglu(x: Rows, w1: Rows, w3: Rows, group_sizes: torch.Tensor, limit: float | None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`~deepinfer.hal.ops.grouped_swiglu.grouped_swiglu` on :func:`grouped_gemm`'s tiles
    (the activation is per element)."""
    check_grouped_swiglu(x, w1, w3, limit)
    return swiglu(grouped_gemm(x, w1, group_sizes), grouped_gemm(x, w3, group_sizes), limit, dtype)


def mla_sparse_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                       scale: float, main_keys: int | None = None):
    """:func:`~deepinfer.hal.ops.mla.mla_sparse_prefill`: keys gathered per tile of query rows,
    attention on row tiles of exactly the shape decode uses (``main_keys`` changes nothing here)."""
    mla.check_prefill_args(q, kv, indices, sink, main_keys)
    if not q.shape[0]:
        return mla.mla_sparse_prefill(q, kv, indices, sink, scale)
    size = row_tile(q.device)
    tiles = [_attention(q[start:start + size], *mla.gather_keys(kv, indices[start:start + size]), sink, scale)
             for start in range(0, q.shape[0], size)]
    return _join(tiles, q.shape[0])


def mla_sparse_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                      scale: float, cache_format: str = "fp8", extra_cache: torch.Tensor | None = None,
                      extra_indices: torch.Tensor | None = None, extra_format: str = "fp4"):
    """:func:`~deepinfer.hal.ops.mla.mla_sparse_decode`: one query token per row, attention on
    row tiles of the prefill shape, so a token's output does not depend on the step computing it."""
    keys, valid = mla.decode_keys(q, cache, indices, sink, cache_format, extra_cache, extra_indices, extra_format)
    batch, s_q, heads, dim = q.shape
    out, lse = _attention(q.reshape(batch * s_q, heads, dim), keys, valid, sink, scale)
    return out.reshape(q.shape), lse.reshape(batch, s_q, heads)


def indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_format: str | None = "mxfp4",
                   weight_scale: float = 1.0):
    """:func:`~deepinfer.hal.ops.indexer.indexer_logits` on tiles of query rows x key columns; with
    per-sequence keys ``[B, S, d]``, sequence by sequence, its key tiles from its first key."""
    indexer.check_indexer_logits(q, k, weights, q_format)
    weights = indexer.scaled_weights(weights, weight_scale)  # per element: the tiles see scaled weights
    if k.dim() == 2:
        return _shared_key_logits(q, k, weights, q_format)
    per_seq = q.shape[0] // k.shape[0]
    return torch.cat([_shared_key_logits(q[b * per_seq:(b + 1) * per_seq], k[b], weights[b * per_seq:(b + 1) * per_seq],
                                         q_format) for b in range(k.shape[0])])


def _shared_key_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_format: str | None):
    if not q.shape[0] or not k.shape[0]:
        return indexer.indexer_logits(q, k, weights, q_format)
    keys = k.shape[0]
    columns = [_indexer_rows(q, _tile(k, start, KEY_TILE), weights, q_format)[:, :keys - start]
               for start in range(0, keys, KEY_TILE)]
    return torch.cat(columns, dim=1)


_gate = row_tiled(routing.moe_gate, ROW_TILED["moe_gate"])


def moe_route(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scale: float,
              group=None):
    """:func:`~deepinfer.hal.ops.moe_route.moe_route`: the gate on row tiles, then the dispatch
    (a permutation of rows)."""
    weights, ids = _gate(logits, bias, top_k, routed_scale)
    return (weights, ids) + all_to_all.ep_dispatch(x, ids, weights, logits.shape[1], group)


CUSTOM = {"grouped_gemm": grouped_gemm, "grouped_swiglu": grouped_swiglu, "mla_sparse_prefill": mla_sparse_prefill,
          "mla_sparse_decode": mla_sparse_decode, "indexer_logits": indexer_logits, "moe_route": moe_route}
"""Ops with their own tiling (expert segments, attention on gathered keys, key columns, the gate's rows)."""


def batch_invariant_implementations() -> dict[str, Callable]:
    """Op name -> batch-invariant callable, for every declared op this module classifies."""
    table: dict[str, Callable] = {}
    for name, spec in SPECS.items():
        if name in ROW_TILED:
            table[name] = row_tiled(spec.reference, ROW_TILED[name])
        elif name in CUSTOM:
            table[name] = CUSTOM[name]
        elif name in INVARIANT_AS_IS:
            table[name] = spec.reference
    return table


def _row_count(values: list[Any]) -> int:
    """The common dim-0 size of the row arguments (None skipped); 0 when absent or malformed."""
    counts = set()
    for value in values:
        if value is None:
            continue
        data = value.data if isinstance(value, Quantized) else value
        if not isinstance(data, torch.Tensor) or data.dim() == 0:
            return 0
        counts.add(data.shape[0])
    return counts.pop() if len(counts) == 1 else 0


def _tile(value: Rows, start: int, size: int) -> Rows:
    """Rows ``start .. start + size - 1`` of ``value`` in a fresh contiguous buffer, rows past the
    end filled with copies of the last row."""
    if isinstance(value, Quantized):
        return Quantized(_tile(value.data, start, size), _tile(value.scale, start, size), value.fmt, value.block)
    return value.index_select(0, _tile_rows(start, size, value.shape[0], value.device))


@functools.lru_cache(maxsize=1024)
def _tile_rows(start: int, size: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + size, device=device).clamp_(max=count - 1)


def _device(value: Rows) -> torch.device:
    return (value.data if isinstance(value, Quantized) else value).device


def _join(outputs: list, count: int):
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(_join([out[i] for out in outputs], count) for i in range(len(first)))
    return (torch.cat(outputs) if len(outputs) > 1 else first)[:count]
