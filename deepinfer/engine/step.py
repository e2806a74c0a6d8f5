"""What one engine step did (:class:`StepStats`) and a step still in flight (:class:`LaunchedStep`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from deepinfer.decoding.dspark import PendingDrafts
from deepinfer.decoding.sampler import PendingEmissions
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Batch


@dataclass
class StepStats:
    """What one :meth:`LLM.step` did: the requests that finished, the sequences, prompt tokens
    and decode rows (each request's last token plus its drafts) of the step it launched and
    whether that was a pure decode step, and the drafts verified and accepted in the step(s) it
    collected."""

    finished: list[Request] = field(default_factory=list)
    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    decode: bool = False

    def count_launch(self, batch: Batch) -> None:
        self.num_seqs, self.decode = len(batch.chunks), bool(batch.chunks) and batch.decode
        for chunk in batch.chunks:
            prompt = len(chunk.request.prompt_token_ids)
            prefill = max(0, min(chunk.start + len(chunk.token_ids), prompt) - chunk.start)
            self.num_prefill_tokens += prefill
            self.num_decode_tokens += len(chunk.token_ids) - prefill

    def count_emissions(self, emissions) -> None:
        self.num_drafted += sum(e.drafted for e in emissions)
        self.num_accepted += sum(e.accepted for e in emissions)


@dataclass
class LaunchedStep:
    """A step whose forward, sampling and draft pass are queued: its batch, the chunks that
    sample, the wait for their pending emissions and drafts, and the finished requests whose
    cache it still writes."""

    batch: Batch
    sampling: list
    pending: Callable[[], "tuple[PendingEmissions, PendingDrafts | None]"]
    release_after: list[Request] = field(default_factory=list)
