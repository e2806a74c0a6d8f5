"""DSpark speculative decoding: draft after each step, verify in the next one."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.decoding.verify_schedule import (
    StepTimeCurve, VerifyCost, cumulative_rates, verify_lengths_from_history,
)
from deepinfer.hal.value_checks import skip_value_checks
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.interface import GenerativeModel


HISTORY = 3
"""Rounds of cumulative rates a request keeps: the judged drafts' and the two before."""


class DSpark:
    """Proposes ``num_draft_tokens`` drafts per request with one parallel pass of the draft
    layers (the model's :meth:`draft`: Markov-corrected sampling, confidence head), run by the
    engine's runner. With ``varlen`` the verify length per request comes from the cumulative
    confidences of earlier rounds (never of the drafts being judged, which would bias the
    output: :mod:`~deepinfer.decoding.verify_schedule`) and a step-time curve measured at
    warm-up (with ``verify_cost="deepinfer"`` a line over ``buckets``, the padded row counts steps
    run as, learning from live steps); otherwise every draft is verified."""

    def __init__(self, model: GenerativeModel, runner, num_draft_tokens: int, varlen: bool,
                 confidence_temperature: float | tuple[float, ...], max_rows: int, verify_cost: str = "deepinfer",
                 buckets: list[int] | None = None):
        if not model.max_draft_tokens:
            raise ValueError("decoding.num_draft_tokens > 0 needs a model with DSpark draft layers "
                             "(num_nextn_predict_layers > 0)")
        if num_draft_tokens > model.max_draft_tokens:
            raise ValueError(f"decoding.num_draft_tokens={num_draft_tokens}: this model drafts at most "
                             f"{model.max_draft_tokens} tokens at once (a verify step must fit in the "
                             f"backtracking room of its SWA rings); lower decoding.num_draft_tokens")
        per_step = confidence_temperature if isinstance(confidence_temperature, tuple) else (confidence_temperature,)
        if min(per_step) <= 0 or len(per_step) not in (1, num_draft_tokens):
            raise ValueError(f"decoding.confidence_temperature must be > 0, one value or one per draft step "
                             f"({num_draft_tokens}); got {confidence_temperature}")
        self.model, self.runner = model, runner
        self.k, self.varlen = num_draft_tokens, varlen
        self.max_model_len = model.max_model_len
        self.step_time = self.measure_step_time(max_rows) if varlen else None
        if varlen and verify_cost == "deepinfer":
            self.step_time = VerifyCost.fit(self.step_time, buckets or self.step_time.tokens)

    def observe(self, rows: int, seconds: float) -> None:
        """A verify step of ``rows`` rows took ``seconds`` (DeepInfer's cost model learns from it)."""
        if isinstance(self.step_time, VerifyCost):
            self.step_time.observe(rows, seconds)

    def assign_verify_drafts(self, requests) -> None:
        """Set each decoding request's ``verify_drafts`` (a prefix of its drafts; placeholders
        for drafts a launched step is still proposing, which the device fills in)."""
        from deepinfer.engine.request import PLACEHOLDER

        ready = [r for r in requests if (r.drafts or r.pending_drafts) and r.num_pending == 1]
        for request in requests:
            request.verify_drafts = []
        if not ready:
            return
        if self.varlen:
            earlier = [self.earlier_rates(r) for r in ready]
            lengths = verify_lengths_from_history([e[0] for e in earlier], [e[1] for e in earlier], self.step_time)
        else:
            lengths = [self.k if r.pending_drafts else len(r.drafts) for r in ready]
        for request, length in zip(ready, lengths):
            drafts = [PLACEHOLDER] * self.k if request.pending_drafts else request.drafts
            request.verify_drafts = drafts[:max(0, min(length, self.room(request)))]
            request.num_clipped_drafts += max(0, min(length, len(drafts)) - len(request.verify_drafts))

    def earlier_rates(self, request) -> tuple[list[float], list[float]]:
        """The cumulative rates of the drafts ``request`` received one and two rounds before the
        drafts it verifies next (all 1.0 where it has none): what the verify length is chosen
        from, never the judged drafts' own rates."""
        history = request.rate_history if request.pending_drafts else request.rate_history[:-1]
        unknown = [1.0] * self.k
        return (history[-1] if history else unknown), (history[-2] if len(history) > 1 else unknown)

    def room(self, request, unconfirmed: int = 0) -> int:
        """Drafts ``request`` may still verify in one step: its next step must leave room for a
        final token within ``max_tokens`` and ``max_model_len``. ``unconfirmed``: drafts a
        launched step verifies, counted as all accepted (the least room there may be)."""
        return min(request.params.max_tokens - len(request.output_token_ids) - unconfirmed - (unconfirmed > 0) - 1,
                   self.max_model_len - 1 - request.num_computed - unconfirmed)

    def drafts_after(self, chunk) -> bool:
        """Whether the draft pass after ``chunk``'s step proposes for its request: a full block of
        drafts must fit within ``max_model_len`` even if the step accepts every draft it verifies."""
        return chunk.start + len(chunk.token_ids) + self.k <= self.max_model_len

    def launch(self, chunks) -> "PendingDrafts | None":
        """Queue the draft pass for ``chunks`` (sampling chunks of the step just queued, each with
        :meth:`drafts_after`); their distributions stay on the device (``draft_logprobs``), tokens
        and confidences come to the host in one copy."""
        if not chunks:
            return None
        proposal = self.runner.draft(chunks)
        for b, chunk in enumerate(chunks):
            chunk.request.draft_logprobs = proposal.logprobs[b]
        both = torch.cat([proposal.tokens.double(), proposal.confidences.double()], dim=1)
        return PendingDrafts([c.request for c in chunks], self.runner.runtime.start_download(both))

    def receive(self, requests, drafted: "PendingDrafts | None") -> None:
        """After a step is collected: the drafts proposed for its sampling ``requests`` (from
        ``drafted``, :meth:`launch`'s copy), for those still running; the others have none."""
        from deepinfer.engine.request import Status

        rows = {}
        if drafted is not None:
            host = drafted.fetch()
            tokens, confidences = host[:, :self.k].long().tolist(), host[:, self.k:].tolist()
            rows = {id(r): b for b, r in enumerate(drafted.requests)}
        for request in requests:
            b = rows.get(id(request))
            if b is not None:
                request.pending_drafts -= self.k
            if b is None or request.status is not Status.RUNNING:
                request.drafts, request.draft_confidences = [], []
            else:
                request.drafts, request.draft_confidences = tokens[b], confidences[b]
                request.rate_history = (request.rate_history + [cumulative_rates(confidences[b])])[-HISTORY:]

    def measure_step_time(self, max_rows: int) -> StepTimeCurve:
        """Seconds of a decode forward by total query rows (1, 2, 4, ... max_rows), measured on
        scratch caches: the median of three runs after one warm-up."""
        model, device = self.model, self.runner.runtime.device
        totals, seconds = [], []
        total = 1
        while True:
            caches = model.allocate_caches(total + 1, total + 1)
            ctx = ForwardContext.for_sequences([[self.model.draft_noise_token]] * total, [self.k + 1] * total,
                                               list(range(1, total + 1)), [[b] for b in range(1, total + 1)],
                                               decode=True, device=device)
            runs = []
            with torch.no_grad(), skip_value_checks():
                for attempt in range(4):
                    started = time.perf_counter()
                    model(ctx, caches).sum().item()
                    if attempt:
                        runs.append(time.perf_counter() - started)
            totals.append(total)
            seconds.append(statistics.median(runs))
            if total >= max_rows:
                return StepTimeCurve(totals, seconds)
            total = min(2 * total, max_rows)


@dataclass
class PendingDrafts:
    """A queued draft pass: the requests it drafts for, in row order, and the wait for its copy
    of tokens and confidences."""

    requests: list
    fetch: Callable[[], torch.Tensor]
