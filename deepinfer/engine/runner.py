"""ModelRunner: turns a scheduled batch into one forward pass and one sampling call."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.scheduler import Batch
from deepinfer.hal.registry import OpTable
from deepinfer.models.forward_context import ForwardContext


@dataclass
class Sampled:
    """Tokens drawn for the sampling chunks of a batch, in chunk order, with their top
    log-probabilities when a request asked for them."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class ModelRunner:
    """Owns the model and its caches on one device."""

    def __init__(self, model, ops: OpTable, num_blocks: int, num_state_slots: int, device: torch.device):
        self.model, self.ops, self.device = model, ops, device
        self.caches = model.allocate_caches(num_blocks, num_state_slots)

    def run(self, batch: Batch) -> Sampled:
        ctx = self._context(batch)
        with torch.no_grad():
            logits = self.model(ctx, self.caches)
        return self._sample(batch, logits)

    def _context(self, batch: Batch) -> ForwardContext:
        chunks = batch.chunks
        ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
        sampling = torch.tensor([c.samples for c in chunks], dtype=torch.bool)
        ctx = ForwardContext.for_sequences(
            [c.token_ids for c in chunks], [c.start for c in chunks], [c.request.state_slot for c in chunks],
            [c.request.blocks for c in chunks], decode=batch.decode, device=self.device)
        ctx.logits_indices = ends[sampling].to(self.device)
        return ctx

    def _sample(self, batch: Batch, logits: torch.Tensor) -> Sampled:
        chunks = [c for c in batch.chunks if c.samples]
        if not chunks:
            return Sampled([], [])
        params = [c.request.params for c in chunks]
        as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=logits.device)  # noqa: E731
        token_ids, logprobs = self.ops.sample(
            logits,
            as_tensor([p.temperature for p in params], torch.float32),
            as_tensor([p.top_p for p in params], torch.float32),
            as_tensor([p.top_k for p in params], torch.int64),
            as_tensor([_as_int64(c.request.seed) for c in chunks], torch.int64),
            as_tensor([c.start + len(c.token_ids) for c in chunks], torch.int64),
        )
        ids = token_ids.tolist()
        top = [_top_logprobs(logprobs[i], ids[i], p.logprobs) if p.logprobs is not None else None
               for i, p in enumerate(params)]
        return Sampled(ids, top)


def _as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _top_logprobs(row: torch.Tensor, chosen: int, count: int) -> dict[int, float]:
    values, ids = row.topk(count) if count else (row[:0], torch.empty(0, dtype=torch.long))
    out = {int(i): float(v) for i, v in zip(ids, values)}
    out[chosen] = float(row[chosen])
    return out
