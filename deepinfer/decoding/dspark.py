"""DSpark speculative decoding: draft after each step, verify in the next one."""
from __future__ import annotations

import statistics
import time

import torch

from deepinfer.decoding.verify_schedule import StepTimeCurve, choose_verify_lengths, cumulative_rates
from deepinfer.hal.value_checks import skip_value_checks
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.interface import GenerativeModel


class DSpark:
    """Proposes ``num_draft_tokens`` drafts per request with one parallel pass of the draft
    layers (the model's :meth:`draft`: Markov-corrected sampling, confidence head), run by the
    engine's runner. With ``varlen`` the verify length per request comes from the cumulative
    confidences and a step-time curve measured at warm-up; otherwise every draft is verified."""

    def __init__(self, model: GenerativeModel, runner, num_draft_tokens: int, varlen: bool,
                 confidence_temperature: float, max_rows: int):
        if not model.max_draft_tokens:
            raise ValueError("decoding.num_draft_tokens > 0 needs a model with DSpark draft layers "
                             "(num_nextn_predict_layers > 0)")
        if num_draft_tokens > model.max_draft_tokens:
            raise ValueError(f"decoding.num_draft_tokens={num_draft_tokens}: this model drafts at most "
                             f"{model.max_draft_tokens} tokens at once (a verify step must fit in the "
                             f"backtracking room of its SWA rings); lower decoding.num_draft_tokens")
        if confidence_temperature <= 0:
            raise ValueError(f"decoding.confidence_temperature must be > 0, got {confidence_temperature}")
        self.model, self.runner = model, runner
        self.k, self.varlen = num_draft_tokens, varlen
        self.max_model_len = model.max_model_len
        self.step_time = self.measure_step_time(max_rows) if varlen else None

    def assign_verify_drafts(self, requests) -> None:
        """Set each decoding request's ``verify_drafts`` (a prefix of its drafts)."""
        ready = [r for r in requests if r.drafts and r.num_pending == 1]
        for request in requests:
            request.verify_drafts = []
        if not ready:
            return
        if self.varlen:
            rates = [cumulative_rates(r.draft_confidences) for r in ready]
            lengths = choose_verify_lengths(rates, self.step_time)
        else:
            lengths = [len(r.drafts) for r in ready]
        for request, length in zip(ready, lengths):
            room = min(request.params.max_tokens - len(request.output_token_ids) - 1,
                       self.max_model_len - 1 - request.num_computed)
            request.verify_drafts = request.drafts[:max(0, min(length, room))]

    def propose(self, requests) -> None:
        """Draft for every request whose last token is its only uncomputed one; the tokens and
        confidences come to the host in one copy, the distributions stay on the device."""
        for request in requests:
            request.drafts, request.draft_logprobs, request.draft_confidences = [], None, []
        ready = [r for r in requests if r.num_pending == 1 and r.num_computed + self.k <= self.max_model_len]
        if not ready:
            return
        proposal = self.runner.draft(ready)
        host = self.runner.runtime.download(torch.cat([proposal.tokens.double(), proposal.confidences.double()], dim=1))
        tokens, confidences = host[:, :self.k].long().tolist(), host[:, self.k:].tolist()
        for b, request in enumerate(ready):
            request.drafts = tokens[b]
            request.draft_logprobs = proposal.logprobs[b]
            request.draft_confidences = confidences[b]

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
