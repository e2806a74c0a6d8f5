"""Sparse indexer ("lightning indexer" style): per-query logits over compressed keys, then top-k."""
from __future__ import annotations

import numpy as np
import torch

from deepinfer.hal.formats import cast_back
from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

Q_FORMATS = ("mxfp4", None)


def indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                   q_format: str | None = "mxfp4", weight_scale: float = 1.0) -> torch.Tensor:
    """``logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``, float32 ``[T, S]``, where ``w`` is
    ``weights`` (float32 or bf16 ``[T, nh]``) in float32 times ``weight_scale`` rounded to float32
    (:func:`scaled_weights`: the indexer's head weights leave their projection in the activation
    dtype and are scaled in float32).

    ``q [T, nh, d]``; ``k`` holds the dequantized index keys, either
    ``[S, d]`` (every query scores every key) or ``[B, S, d]`` (one key list per sequence: the
    queries are ``T / B`` consecutive rows per sequence, and query ``t`` scores the keys of
    sequence ``t // (T / B)``, as a decode step lays them out). With ``q_format="mxfp4"`` (the
    model's FP4 index queries) ``q`` is first cast through MXFP4 (e2m1, UE8M0 scale per 32 along
    ``d``, so ``d % 32 == 0``); with None it is used as given. Heads are summed in order."""
    check_indexer_logits(q, k, weights, q_format)
    queries = cast_back(q, "mxfp4", 32) if q_format == "mxfp4" else q.float()
    weights = scaled_weights(weights, weight_scale)
    if k.dim() == 3:
        queries, weights = queries.unflatten(0, (k.shape[0], -1)), weights.unflatten(0, (k.shape[0], -1))
    keys = k.float().transpose(-1, -2)
    logits = torch.zeros(*queries.shape[:-2], keys.shape[-1], dtype=torch.float32, device=q.device)
    for head in range(q.shape[1]):  # head by head: memory [T, S], not [T, nh, S]
        logits.addcmul_(torch.relu(queries[..., head, :] @ keys), weights[..., head, None])
    return logits.reshape(q.shape[0], k.shape[-2])


def scaled_weights(weights: torch.Tensor, weight_scale: float) -> torch.Tensor:
    """``weights`` in float32 times ``weight_scale`` rounded to float32 (a float32 product; the
    scale stays a host scalar, so a CUDA graph can capture the product)."""
    return weights.float() * float(np.float32(weight_scale))


def check_indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, q_format: str | None) -> None:
    """Raise a clear error unless the arguments fit :func:`indexer_logits`'s contract."""
    if q_format not in Q_FORMATS:
        raise ValueError(f"q_format must be one of {Q_FORMATS}, got {q_format!r}")
    if q.ndim != 3 or k.ndim not in (2, 3) or k.shape[-1] != q.shape[2]:
        raise ValueError(f"indexer_logits expects q [T, nh, d] and k [S, d] or [B, S, d]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if k.ndim == 3 and (k.shape[0] == 0 or q.shape[0] % k.shape[0]):
        raise ValueError(f"k [B={k.shape[0]}, S, d] needs the T={q.shape[0]} queries to split into B equal runs")
    if weights.shape != q.shape[:2] or weights.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weights must be float32 or bf16 [T, nh] = {tuple(q.shape[:2])}, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if q_format == "mxfp4" and q.shape[2] % 32:
        raise ValueError(f"q_format 'mxfp4' quantizes d in blocks of 32; d={q.shape[2]} is not a multiple")


def indexer_topk(logits: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, k: int,
                 row_table: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the ``k`` best columns of a window, as int32 ``[T, k]`` offsets into the window.

    Row ``t`` considers columns ``starts[t] .. starts[t] + lengths[t] - 1`` of ``logits [T, S]``
    (int64 ``starts``, ``lengths``) and keeps the ``k`` highest logits (ties: the lower column).
    Returned indices are relative to ``starts[t]``, sorted ascending, padded with -1 when the
    window holds fewer than ``k`` columns (then all of them are returned).

    With ``row_table`` (int32 ``[T, >= max lengths]``) each offset ``o`` is returned as
    ``row_table[t, o]`` instead (padding stays -1): the cache rows of the chosen keys."""
    check_windows(logits, starts, lengths, k, row_table)
    tokens, width = logits.shape
    window, in_window = window_logits(logits, starts, lengths)
    ranked = torch.sort(window, dim=1, descending=True, stable=True).indices[:, :k]
    chosen = torch.where(in_window.gather(1, ranked), ranked, width)
    chosen = torch.sort(chosen, dim=1).values
    chosen = torch.where(chosen == width, -1, chosen).to(torch.int32)
    padding = torch.full((tokens, k - chosen.shape[1]), -1, dtype=torch.int32, device=logits.device)
    chosen = torch.cat((chosen, padding), dim=1)
    if row_table is None:
        return chosen
    mapped = row_table.gather(1, chosen.clamp(min=0).long()) if row_table.shape[1] else chosen
    return torch.where(chosen >= 0, mapped, -1)


def window_logits(logits: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor):
    """``(window [T, S], in_window bool [T, S])``: row ``t``'s columns ``starts[t] ..`` moved to
    offsets ``0 ..``, ``-inf`` past its ``lengths[t]``."""
    offsets = torch.arange(logits.shape[1], device=logits.device)
    in_window = offsets < lengths[:, None]
    columns = (starts[:, None] + offsets).clamp(max=max(logits.shape[1] - 1, 0))
    return torch.where(in_window, logits.gather(1, columns), torch.full_like(logits, float("-inf"))), in_window


def check_windows(logits, starts, lengths, k, row_table=None) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, S], got shape {tuple(logits.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    tokens, width = logits.shape
    for name, value in (("starts", starts), ("lengths", lengths)):
        if value.dtype != torch.int64 or tuple(value.shape) != (tokens,):
            raise ValueError(f"{name} must be int64 [{tokens}], got {value.dtype} {tuple(value.shape)}")
    if value_checks() and tokens and ((starts < 0).any() or (lengths < 0).any() or (starts + lengths > width).any()):
        raise ValueError(f"each window starts[t] .. starts[t] + lengths[t] - 1 must lie in the {width} "
                         f"columns of logits (non-negative starts and lengths)")
    if row_table is not None:
        if row_table.dtype != torch.int32 or row_table.dim() != 2 or row_table.shape[0] != tokens:
            raise ValueError(f"row_table must be int32 [{tokens}, n], got {row_table.dtype} {tuple(row_table.shape)}")
        if value_checks() and tokens and bool((lengths > row_table.shape[1]).any()):
            raise ValueError(f"row_table's {row_table.shape[1]} columns must cover every window (lengths up to "
                             f"{int(lengths.max())})")


def _weights(tokens, heads, gen, device, scaled):
    """Head weights: float32 of scale ``heads ** -0.5``; ``scaled``: bf16 projections of unit
    scale with the model's ``weight_scale`` of ``heads`` heads of 128."""
    if not scaled:
        return {"weights": (heads ** -0.5 * torch.randn(tokens, heads, generator=gen)).to(device)}
    return {"weights": torch.randn(tokens, heads, generator=gen).to(device, torch.bfloat16),
            "weight_scale": (heads * 128) ** -0.5}


def _logits_case(tokens, heads, dim, keys, q_format="mxfp4", dtype=torch.float32, scaled=False):
    def make(gen: torch.Generator, device: torch.device):
        return {"q": torch.randn(tokens, heads, dim, generator=gen).to(device, dtype),
                "k": torch.randn(keys, dim, generator=gen).to(device, dtype),
                **_weights(tokens, heads, gen, device, scaled), "q_format": q_format}
    return make


def _batched_logits_case(seqs, queries_per_seq, heads, dim, keys, dtype=torch.float32, scaled=False):
    def make(gen: torch.Generator, device: torch.device):
        tokens = seqs * queries_per_seq
        return {"q": torch.randn(tokens, heads, dim, generator=gen).to(device, dtype),
                "k": torch.randn(seqs, keys, dim, generator=gen).to(device, dtype),
                **_weights(tokens, heads, gen, device, scaled), "q_format": "mxfp4"}
    return make


def _topk_case(width, starts, lengths, k, distinct_values=None, mapped=False):
    """``distinct_values``: draw logits from that many integers, so that ties are common;
    ``mapped``: pass a ``row_table`` of distinct random rows."""
    def make(gen: torch.Generator, device: torch.device):
        shape = (len(starts), width)
        logits = (torch.randint(0, distinct_values, shape, generator=gen).float() if distinct_values
                  else torch.randn(shape, generator=gen))
        args = {"logits": logits.to(device), "starts": torch.tensor(starts, device=device),
                "lengths": torch.tensor(lengths, device=device), "k": k}
        if mapped:
            table = torch.randperm(4 * len(starts) * width, generator=gen)[:len(starts) * width]
            args["row_table"] = table.view(len(starts), width).to(device, torch.int32)
        return args
    return make


def _real_windows(tokens, width):
    """Windows of growing length (shorter and longer than k), ending at or before the last column."""
    return list(range(tokens)), [width * (t + 1) // tokens - t for t in range(tokens)]


register(OpSpec(
    name="indexer_logits",
    summary="indexer logits: sum_h w_h * relu(q_h . k), q cast through MXFP4",
    reference=indexer_logits,
    cases=(
        OpCase("tiny", _logits_case(3, 2, 32, 5)),
        OpCase("tiny_two_blocks", _logits_case(4, 3, 64, 7)),
        OpCase("tiny_unquantized_q", _logits_case(3, 2, 16, 6, q_format=None)),
        OpCase("v41_prefill", _logits_case(16, 64, 128, 2048), "real"),
        OpCase("tiny_bf16", _logits_case(5, 3, 64, 200, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_prefill_bf16", _logits_case(16, 64, 128, 2048, dtype=torch.bfloat16), "real",
               dtype=torch.bfloat16),
        OpCase("tiny_per_sequence", _batched_logits_case(3, 2, 2, 32, 5)),
        OpCase("tiny_per_sequence_bf16", _batched_logits_case(4, 1, 3, 64, 130, dtype=torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("v41_decode_bf16", _batched_logits_case(8, 6, 64, 128, 1024, dtype=torch.bfloat16), "real",
               dtype=torch.bfloat16),
        OpCase("tiny_scaled_bf16", _batched_logits_case(2, 3, 4, 64, 70, dtype=torch.bfloat16, scaled=True),
               dtype=torch.bfloat16),
        OpCase("v41_decode_scaled_bf16", _batched_logits_case(4, 1, 64, 128, 512, dtype=torch.bfloat16, scaled=True),
               "real", dtype=torch.bfloat16),
    ),
))

register(OpSpec(
    name="indexer_topk",
    activations=False,
    summary="top-k columns of a per-row window, ascending offsets, -1 padding",
    reference=indexer_topk,
    cases=(
        OpCase("tiny", _topk_case(16, [0, 3, 5, 10], [16, 10, 8, 6], 4)),
        OpCase("tiny_ties", _topk_case(12, [0, 2, 1], [12, 9, 11], 5, distinct_values=3)),
        OpCase("tiny_short_and_empty", _topk_case(10, [0, 4, 9, 10], [3, 0, 1, 0], 4)),
        OpCase("tiny_rows", _topk_case(16, [0, 0, 0, 0], [16, 3, 9, 0], 4, distinct_values=5, mapped=True)),
        OpCase("v41_prefill", _topk_case(2048, *_real_windows(16, 2048), 512), "real"),
        OpCase("v41_decode_rows", _topk_case(4097, [0] * 8, [4097, 3000, 600, 512, 100, 2048, 0, 1], 512,
                                             mapped=True), "real"),
    ),
))
