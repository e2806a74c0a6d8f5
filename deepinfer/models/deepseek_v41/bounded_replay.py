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


def replay_starts(prompt_lens: list[int], keep_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``int64 [B]``: the first position each prompt's consumer layers process and see."""
    return (torch.tensor(prompt_lens, dtype=torch.long, device=device) - keep_tokens).clamp(min=0)


def consumer_rows(ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (ascending) the consumer layers compute under bounded replay, and their count per
    sequence: the chunk's positions at or after ``ctx.replay_start``, else its last row."""
    start = ctx.replay_start
    if start is None or start.dtype != torch.int64 or tuple(start.shape) != (ctx.num_seqs,):
        got = None if start is None else f"{start.dtype} {tuple(start.shape)}"
        raise ValueError(f"bounded replay needs ctx.replay_start as int64 [num_seqs={ctx.num_seqs}], got {got}")
    ends = ctx.context_lens.long()
    first = torch.minimum(torch.maximum(start, ctx.chunk_start), ends - 1)
    counts = torch.minimum(ends - first, ctx.query_lens.long())
    seq = torch.repeat_interleave(torch.arange(ctx.num_seqs, device=counts.device), counts)
    before = counts.cumsum(0) - counts
    offset = torch.arange(seq.numel(), device=counts.device) - before[seq]
    return (ctx.query_start[1:] - counts)[seq] + offset, counts


def enter_consumer_half(layer, residual: torch.Tensor, pre: torch.Tensor | None, ctx: ForwardContext,
                        yoco) -> tuple[ForwardContext, Callable]:
    """Called before the first consumer ``layer`` when ``ctx.replay_start`` is set.

    Returns the context the consumer half runs on and ``keep``, which gathers any per-row tensor
    (or None) to its rows. Under ``compact`` (unless every row is kept) the YOCO shared hidden is
    taken here on the full layout (``residual``, with the attention input mix ``pre``) and put in
    ``yoco`` with ``ctx``, so consumer compressed KV and index K are still stored for every token."""
    rows, counts = consumer_rows(ctx)
    logits_rows = _logits_rows(ctx, rows)
    if not ctx.replay_compact or rows.numel() == ctx.num_tokens:
        return ctx, lambda tensor: tensor
    hc = layer.hc_attn
    mix = pre if pre is not None else hc.mixes(residual)[0]
    yoco.shared_hidden, yoco.shared_ctx = layer.attn_norm(hc.ops.mhc_pre(residual, mix)), ctx
    view = dataclasses.replace(ctx, input_ids=ctx.input_ids[rows], positions=ctx.positions[rows],
                               query_lens=counts, logits_indices=logits_rows)
    return view, lambda tensor: None if tensor is None else tensor[rows]


def _logits_rows(ctx: ForwardContext, rows: torch.Tensor) -> torch.Tensor:
    """Where ``ctx.logits_indices`` fall among ``rows``; refuses rows the consumers skip."""
    wanted = ctx.logits_indices.long()
    at = torch.searchsorted(rows, wanted).clamp(max=max(rows.numel() - 1, 0))
    missing = (rows[at] != wanted).nonzero() if rows.numel() else torch.arange(wanted.numel())
    if missing.numel():
        row = int(wanted[missing.flatten()[0]])
        seq = int(ctx.seq_of_token[row])
        raise ValueError(f"logits of row {row} (position {int(ctx.positions[row])} of sequence {seq}) were asked "
                         f"for, but under bounded replay the consumer layers only process positions >= "
                         f"replay_start {int(ctx.replay_start[seq])} and each chunk's last row; ask for those "
                         f"rows only (prompt logprobs need engine.bounded_replay.mode=off)")
    return at
