"""SWA bounded replay (YOCO prefill truncation): the YOCO consumer layers process and see only
the last ``keep_tokens`` tokens of each prompt.

Producer layers run on every row. Consumer compressed KV and index K come from the shared hidden
of every token, so long-range context stays exact; only the consumer SWA window is bounded: a
consumer query at position ``p`` sees raw keys in ``[max(p - window + 1, replay_start), p]``,
with ``replay_start = max(0, prompt_len - keep_tokens)``. ``mask`` computes every row with that
visibility; ``compact`` computes, per chunk, only the rows at or after ``replay_start`` (or the
chunk's last row when it has none), and gives those rows the same values (bitwise with
batch-invariant ops)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.forward_context import ForwardContext


def check_keep_tokens(keep_tokens: int, cfg: DeepseekV41Config) -> None:
    """Refuse a ``keep_tokens`` that cannot hold the consumer SWA ring (window + backtracking)."""
    need = cfg.sliding_window + cfg.max_backtracking
    if not isinstance(keep_tokens, int) or keep_tokens < need:
        raise ValueError(f"engine.bounded_replay.keep_tokens={keep_tokens!r} is too small for this model: it must be "
                         f">= sliding_window + max_backtracking = {cfg.sliding_window} + {cfg.max_backtracking} = "
                         f"{need}; raise it or set engine.bounded_replay.mode=off")


def replay_starts(prompt_lens: list[int], keep_tokens: int) -> list[int]:
    """The first position each prompt's consumer layers process and see."""
    return [max(0, n - keep_tokens) for n in prompt_lens]


def enter_consumer_half(layer, residual: torch.Tensor, pre: torch.Tensor | None, ctx: ForwardContext,
                        yoco, x: torch.Tensor | None = None) -> tuple[ForwardContext, Callable]:
    """Called before the first consumer ``layer`` when ``ctx.replay_start`` is set.

    Returns the context the consumer half runs on and ``keep``, which gathers any per-row tensor
    (or None) to its rows. Under ``compact`` (unless every row is kept; a decode step always
    keeps every row) the YOCO shared hidden is taken here on the full layout (``residual``, with
    the attention input mix ``pre``, or the normalised attention input ``x`` when the previous
    layer gave it) and put in ``yoco`` with ``ctx``, so consumer compressed KV and index K are
    still stored for every token. The compact rows come from the host
    (``ctx.consumer``), so nothing here reads the device."""
    start = ctx.replay_start
    if start is None or start.dtype != torch.int64 or tuple(start.shape) != (ctx.num_seqs,):
        got = None if start is None else f"{start.dtype} {tuple(start.shape)}"
        raise ValueError(f"bounded replay needs ctx.replay_start as int64 [num_seqs={ctx.num_seqs}], got {got}")
    if not ctx.replay_compact or ctx.decode:
        return ctx, lambda tensor: tensor
    consumer = ctx.consumer
    if consumer is None:
        raise ValueError("compact bounded replay needs the consumer rows laid out on the host: build the context "
                         "with ForwardContext.for_sequences(..., replay_starts=..., replay_compact=True)")
    if consumer.rows.numel() == ctx.num_tokens:
        return ctx, lambda tensor: tensor
    rows = consumer.rows
    if x is None:
        hc = layer.hc_attn
        x = layer.attn_norm(hc.ops.mhc_pre(residual, pre if pre is not None else hc.mixes(residual)[0]))
    yoco.shared_hidden, yoco.shared_ctx = x, ctx
    seq_of_token = ctx.seq_of_token[rows]
    view = dataclasses.replace(ctx, input_ids=ctx.input_ids[rows], positions=ctx.positions[rows],
                               query_lens=consumer.counts, logits_indices=consumer.logits_indices,
                               seq_of_token=seq_of_token, query_start=consumer.query_start,
                               chunk_start=consumer.chunk_start, chunk_start_of_token=consumer.chunk_start[seq_of_token],
                               slot_of_token=ctx.slot_of_token[rows], query_lens_host=None, consumer=None)
    return view, lambda tensor: None if tensor is None else tensor[rows]
