"""ModelRunner: turns a scheduled batch into one forward pass over the paged caches."""
from __future__ import annotations

import torch

from deepinfer.engine.scheduler import Batch
from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.bounded_replay import replay_starts
from deepinfer.models.forward_context import ForwardContext


class ModelRunner:
    """Owns the model and its caches on one device. ``write_draft_cache``: every forward also
    fills the DSpark draft layers' main caches. ``logits_trace``: set it to a dict (debugging,
    invariance tests) and each step's logits rows are appended there under their request id.
    ``bounded_replay`` (an ``engine.bounded_replay`` config): the kept suffix is counted from each
    request's own prompt, so a request recomputed after preemption replays as it first did."""

    def __init__(self, model, ops: OpTable, num_blocks: int, num_state_slots: int, device: torch.device,
                 write_draft_cache: bool = False, bounded_replay=None):
        self.model, self.ops, self.device = model, ops, device
        self.bounded_replay = bounded_replay
        self.write_draft_cache = write_draft_cache
        self.caches = model.allocate_caches(num_blocks, num_state_slots)
        self.logits_trace: dict[int, list[torch.Tensor]] | None = None

    def run(self, batch: Batch) -> torch.Tensor:
        """float32 logits of the rows that emit tokens: for each sampling chunk in order, one row
        per verified draft plus its final row."""
        ctx = self._context(batch)
        with torch.no_grad():
            logits = self.model(ctx, self.caches)
        if self.logits_trace is not None:
            row = 0
            for chunk in (c for c in batch.chunks if c.samples):
                rows = len(chunk.drafts) + 1
                trace = self.logits_trace.setdefault(chunk.request.request_id, [])
                trace.append(logits[row:row + rows].to("cpu", copy=True))
                row += rows
        return logits

    def _context(self, batch: Batch) -> ForwardContext:
        chunks = batch.chunks
        rows, offset = [], 0
        for c in chunks:
            offset += len(c.token_ids)
            if c.samples:
                rows.extend(range(offset - len(c.drafts) - 1, offset))
        replay, starts = self.bounded_replay, None
        if replay is not None and replay.mode != "off":
            starts = replay_starts([len(c.request.prompt_token_ids) for c in chunks], replay.keep_tokens)
        ctx = ForwardContext.for_sequences(
            [c.token_ids for c in chunks], [c.start for c in chunks], [c.request.state_slot for c in chunks],
            [c.request.blocks for c in chunks], decode=batch.decode, logits_rows=rows, replay_starts=starts,
            replay_compact=starts is not None and replay.mode == "compact", device=self.device)
        ctx.write_draft_cache = self.write_draft_cache
        return ctx
