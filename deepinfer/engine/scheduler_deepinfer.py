"""DeepInfer's scheduling (``engine.scheduler=deepinfer``), to reproduce its runs: each step is all
prefill or all decode; while requests decode, a prefill is tried only every ``prefill_interval``
decode steps and only while the cache is at most ``prefill_max_usage`` full (a chunked prompt
already admitted goes on at once, so that its blocks do not wait); admission is whole-prompt FIFO
with blocks reserved for the whole prompt, and at most one prompt per step is chunked (the one that
does not fit what is left of the step); preemption evicts the request with the longest output, and
stops a structured one instead of requeueing it. The engine drafts only after decode steps under
this scheduler, so the first decode after a prefill verifies no drafts (DeepInfer's padding drafts),
and bounded replay of a recomputed request counts its prompt and the outputs it had (ours replays
the original prompt's window).

The default scheduler (:class:`~deepinfer.engine.scheduler.Scheduler`) mixes decodes and prefill
chunks in every step and preempts the most recently admitted request."""
from __future__ import annotations

from typing import Callable

from deepinfer.engine.kv_manager import KVManager
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Batch, Scheduler

PREFILL_INTERVAL = 70
"""Decode steps between two prefill attempts while requests decode (DeepInfer's)."""
PREFILL_MAX_USAGE = 0.9
"""Cache share above which a prefill attempt is skipped (DeepInfer's)."""


class DeepInferScheduler(Scheduler):
    """:class:`~deepinfer.engine.scheduler.Scheduler` with DeepInfer's rules (module docstring).
    ``stop`` finishes a preempted structured request (the engine's finish, with a reason)."""

    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk_tokens: int,
                 whole_verify: bool = False, stop: Callable[[Request, str], None] | None = None,
                 prefill_interval: int = PREFILL_INTERVAL, prefill_max_usage: float = PREFILL_MAX_USAGE):
        super().__init__(kv, max_num_seqs, max_num_batched_tokens, prefill_chunk_tokens, whole_verify)
        self.stop = stop
        self.prefill_interval, self.prefill_max_usage = prefill_interval, prefill_max_usage
        self.decode_steps = 0

    def schedule(self) -> Batch:
        decoding = [r for r in self.running if r.status is Status.RUNNING and r.num_pending == 1]
        prefilling = [r for r in self.running if r.status is Status.RUNNING and r.num_pending > 1]
        attempt = not decoding or bool(prefilling) or (self.decode_steps >= self.prefill_interval
                                                       and self.kv.usage <= self.prefill_max_usage)
        if (prefilling or self.waiting) and attempt:
            batch = self._prefill(prefilling)
            if batch.chunks:
                self.decode_steps = 0
                return batch
        batch = self._decode(decoding)
        if batch.chunks:
            self.decode_steps += 1
            return batch
        if self.has_work:
            raise RuntimeError("the scheduler could not fit any request in the KV cache; raise "
                               "engine.num_kv_blocks or lower model.max_model_len")
        return batch

    def _prefill(self, prefilling: list[Request]) -> Batch:
        """Continue the chunked prompt, then admit whole prompts FIFO while they fit; the first
        that does not fit what is left of the step is chunked, unless a prompt already is."""
        budget, chunks, chunked = self.token_budget, [], bool(prefilling)
        for request in prefilling:
            size = min(request.num_pending, budget)
            if size <= 0:
                break
            chunks.append(self._chunk(request, size))
            budget -= size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            whole = request.num_pending
            if (whole > budget and chunked) or not self.kv.can_admit(request.num_computed + whole):
                break
            self.waiting.popleft()
            self.kv.reserve(request, request.num_computed + whole)
            request.status = Status.RUNNING
            self.running.append(request)
            size = min(whole, budget)
            chunks.append(self._chunk(request, size))
            budget -= size
            chunked = chunked or size < whole
        return Batch(chunks)

    def _decode(self, decoding: list[Request]) -> Batch:
        budget, chunks = self.token_budget, []
        for request in list(decoding):
            if request.status is not Status.RUNNING:
                continue
            drafts = request.verify_drafts[:max(budget - 1, 0)]
            if not self._reserve_or_preempt(request, request.num_computed + request.unconfirmed + 1 + len(drafts)):
                continue
            chunks.append(self._chunk(request, 1, drafts))
            budget -= 1 + len(drafts)
        return Batch(chunks)

    def _victim(self) -> Request:
        """The running request with the longest output (the earliest admitted of a tie)."""
        return max((r for r in self.running if r.status is Status.RUNNING),
                   key=lambda r: (len(r.output_token_ids), -self.running.index(r)))

    def _preempt(self, request: Request) -> None:
        """Stop a structured ``request`` (DeepInfer's stop_preempted_request); requeue any other
        to recompute, bounded replay then counting its prompt and outputs."""
        if request.grammar is not None and self.stop is not None:
            request.error = ("preempted: under engine.scheduler=deepinfer a structured request is stopped when the "
                             "cache runs out (DeepInfer's stop_preempted_request)")
            self.num_preemptions += 1
            self.stop(request, "error")
            return
        request.replay_length = len(request.prompt_token_ids) + len(request.output_token_ids)
        super()._preempt(request)
