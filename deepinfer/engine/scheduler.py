"""Continuous batching with chunked prefill and preemption by recompute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer.engine.kv_manager import KVManager
from deepinfer.engine.request import Request, Status


@dataclass
class Chunk:
    """``token_ids`` of ``request`` starting at position ``start``; ``samples`` when the chunk
    ends at the request's last known token, so the step produces its next token. ``drafts`` are
    the DSpark draft tokens appended for verification (the last ``len(drafts)`` token ids; a
    :data:`~deepinfer.engine.request.PLACEHOLDER` for each one still on the device).
    ``slot`` and ``blocks`` are the request's state slot and cache blocks when it was scheduled
    (what the step's device work reads, whatever the host does meanwhile). ``chained``: the
    request's previous step, still in flight, verifies drafts, so ``start`` is a lower bound and
    the device reads the true one (the tokens that step computes)."""

    request: Request
    token_ids: list[int]
    start: int
    samples: bool
    drafts: list[int] = field(default_factory=list)
    slot: int = 0
    blocks: tuple[int, ...] = ()
    chained: bool = False


@dataclass
class Batch:
    """One model step. ``decode``: every chunk is one token continuing a sequence (the
    quantized-cache decode path)."""

    chunks: list[Chunk]

    @property
    def decode(self) -> bool:
        lengths = {len(c.token_ids) for c in self.chunks}
        return len(lengths) == 1 and all(c.start > 0 and len(c.token_ids) == 1 + len(c.drafts) for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    """Builds each step's batch under a token budget.

    Running requests go first, oldest first (decodes and unfinished prefills); waiting requests
    are admitted FIFO while the budget, ``max_num_seqs`` and the cache allow. When blocks run
    out, the most recently admitted running request is preempted: its cache is freed and it
    re-queues at the front, to recompute prompt and outputs later (no request is dropped).
    ``whole_verify`` (batch invariance): a request whose drafts do not all fit in the token
    budget waits for a later step instead of verifying fewer, so what it verifies never depends
    on the rest of the batch."""

    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk_tokens: int,
                 whole_verify: bool = False):
        self.kv = kv
        self.whole_verify = whole_verify
        self.max_num_seqs, self.token_budget, self.chunk_tokens = max_num_seqs, max_num_batched_tokens, prefill_chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        budget, chunks = self.token_budget, []
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget == 0:
                continue
            size = min(request.num_pending, budget, self.chunk_tokens)
            drafts = request.verify_drafts[:budget - size] if request.num_pending == 1 else []
            if self.whole_verify and len(drafts) < len(request.verify_drafts) and request.num_pending == 1:
                continue  # verifies all its drafts in a later step rather than fewer now
            if not self._reserve_or_preempt(request, request.num_computed + request.unconfirmed + size + len(drafts)):
                continue
            chunks.append(self._chunk(request, size, drafts))
            budget -= size + len(drafts)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            size = min(request.num_pending, budget, self.chunk_tokens)
            if not self.kv.can_admit(request.num_computed + size):
                break
            self.waiting.popleft()
            self.kv.reserve(request, request.num_computed + size)
            request.status = Status.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, size))
            budget -= size
        if not chunks and self.has_work:
            raise RuntimeError("the scheduler could not fit any request in the KV cache; raise "
                               "engine.num_kv_blocks or lower model.max_model_len")
        return Batch(chunks)

    def _chunk(self, request: Request, size: int, drafts: list[int] = ()) -> Chunk:
        start = request.num_computed
        tokens = request.token_ids[start:start + size] + list(drafts)
        return Chunk(request, tokens, start, start + size == request.num_tokens, list(drafts), request.state_slot,
                     tuple(request.blocks), chained=request.unconfirmed > 0)

    def _reserve_or_preempt(self, request: Request, num_tokens: int) -> bool:
        while not self.kv.reserve(request, num_tokens):
            victim = self._victim()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _victim(self) -> Request:
        """The running request to preempt when blocks run out: the most recently admitted."""
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.restart(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def restart(self, request: Request) -> None:
        """Free ``request``'s cache and queue it first, to run again from its prompt (the caller
        resets its outputs)."""
        self.kv.release(request)
        self.running.remove(request)
        request.status, request.num_computed = Status.WAITING, 0
        request.drafts, request.verify_drafts = [], []
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str, release: bool = True) -> None:
        """Mark ``request`` finished and free its cache (later, with :meth:`KVManager.release`,
        when ``release`` is False: a launched step still writes there)."""
        request.status, request.finish_reason = Status.FINISHED, reason
        if release:
            self.kv.release(request)
        self.running.remove(request)
