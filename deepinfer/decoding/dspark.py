"""DSpark speculative decoding: draft after each step, verify in the next one."""
from __future__ import annotations

import statistics
import time

import torch

from deepinfer.decoding.verify_schedule import StepTimeCurve, choose_verify_lengths, cumulative_rates
from deepinfer.hal.ops.sampling import SEED_NAMESPACE_DRAFT
from deepinfer.hal.registry import OpTable
from deepinfer.models.forward_context import ForwardContext

class DSpark:
    """Proposes ``num_draft_tokens`` drafts per request with one parallel pass of the draft
    layers, then samples them step by step with the Markov (bigram) correction and scores each
    with the confidence head. With ``varlen`` the verify length per request comes from the
    cumulative confidences and a step-time curve measured at warm-up; otherwise every draft is
    verified."""

    def __init__(self, model, caches, ops: OpTable, num_draft_tokens: int, varlen: bool,
                 confidence_temperature: float, max_model_len: int, max_rows: int):
        cfg = model.cfg
        if not model.mtp:
            raise ValueError("decoding.num_draft_tokens > 0 needs a model with DSpark draft layers "
                             "(num_nextn_predict_layers > 0)")
        if num_draft_tokens + 1 > cfg.max_backtracking:
            raise ValueError(f"decoding.num_draft_tokens={num_draft_tokens} needs max_backtracking >= "
                             f"{num_draft_tokens + 1} (SWA rings keep window + max_backtracking slots); the "
                             f"model has {cfg.max_backtracking}")
        if confidence_temperature <= 0:
            raise ValueError(f"decoding.confidence_temperature must be > 0, got {confidence_temperature}")
        self.model, self.caches, self.ops = model, caches, ops
        self.k, self.varlen, self.temperature = num_draft_tokens, varlen, confidence_temperature
        self.max_model_len = max_model_len
        self.noise_id = cfg.dspark_noise_token_id if cfg.dspark_noise_token_id is not None else cfg.vocab_size - 1
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
        """Draft for every request whose last token is its only uncomputed one."""
        for request in requests:
            request.drafts, request.draft_logprobs, request.draft_confidences = [], None, []
        ready = [r for r in requests if r.num_pending == 1 and r.num_computed + self.k <= self.max_model_len]
        if not ready:
            return
        k, device = self.k, self.model.embed.weight.device
        ctx = ForwardContext.for_sequences(
            [[r.token_ids[-1]] + [self.noise_id] * (k - 1) for r in ready], [r.num_computed for r in ready],
            [r.state_slot for r in ready], [r.blocks for r in ready], decode=True, device=device)
        ctx.draft_block = k
        with torch.no_grad():
            logits, hidden = self.model.draft_forward(ctx, self.caches)
            tokens, logprobs, confidences = self._sample_steps(ready, logits.view(len(ready), k, -1),
                                                               hidden.view(len(ready), k, -1), device)
        for b, request in enumerate(ready):
            request.drafts = tokens[b]
            request.draft_logprobs = logprobs[b]
            request.draft_confidences = confidences[b]

    def _sample_steps(self, ready, logits, hidden, device):
        """Sequential Markov-corrected sampling of the k drafts of every request."""
        head = self.model.mtp[-1]
        params = [r.params for r in ready]
        as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        temperature = as_tensor([p.temperature for p in params], torch.float32)
        top_p = as_tensor([p.top_p for p in params], torch.float32)
        top_k = as_tensor([p.top_k for p in params], torch.int64)
        seeds = as_tensor([_as_int64(r.seed) for r in ready], torch.int64)
        previous = as_tensor([r.token_ids[-1] for r in ready], torch.int64)
        tokens, logprobs, confidences = [], [], []
        for i in range(self.k):
            embedded, correction = head.markov(previous)
            positions = as_tensor([r.num_computed + 1 + i for r in ready], torch.int64)
            ids, step_logprobs = self.ops.sample(logits[:, i] + correction, temperature, top_p, top_k, seeds, positions,
                                                 namespace=SEED_NAMESPACE_DRAFT)
            confidences.append(head.confidence(hidden[:, i], embedded, self.temperature))
            tokens.append(ids)
            logprobs.append(step_logprobs)
            previous = ids
        tokens = torch.stack(tokens, dim=1).tolist()
        confidences = torch.stack(confidences, dim=1).tolist()
        return tokens, torch.stack(logprobs, dim=1), confidences

    def measure_step_time(self, max_rows: int) -> StepTimeCurve:
        """Seconds of a decode forward by total query rows (1, 2, 4, ... max_rows), measured on
        scratch caches: the median of three runs after one warm-up."""
        model, device = self.model, self.model.embed.weight.device
        totals, seconds = [], []
        total = 1
        while True:
            caches = model.allocate_caches(total + 1, total + 1)
            ctx = ForwardContext.for_sequences([[self.noise_id]] * total, [self.k + 1] * total,
                                               list(range(1, total + 1)), [[b] for b in range(1, total + 1)],
                                               decode=True, device=device)
            runs = []
            with torch.no_grad():
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


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
