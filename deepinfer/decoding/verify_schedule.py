"""Confidence-scheduled verification: how many drafts each request verifies this step.

The choice must not depend on the drafts it judges: a draft's confidence depends on the draft
before it, so choosing by the current round's rates would verify a draft more often when it
raises the next one's rate, and bias the sampled distribution. As in DeepInfer, the batch's
total comes from the rates of two rounds back and the split between requests from the last
round's (:func:`verify_lengths_from_history`)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass


def cumulative_rates(confidences: list[float]) -> list[float]:
    """``a_i = c_0 * ... * c_i``: the estimated chance drafts ``0..i`` are all accepted."""
    rates, running = [], 1.0
    for c in confidences:
        running *= c
        rates.append(running)
    return rates


@dataclass
class StepTimeCurve:
    """Measured target-forward seconds by total query tokens, linearly interpolated (and
    extrapolated from the last two points)."""

    tokens: list[int]
    seconds: list[float]

    def __call__(self, total: int) -> float:
        i = bisect.bisect_left(self.tokens, total)
        if i < len(self.tokens) and self.tokens[i] == total:
            return self.seconds[i]
        lo, hi = (i - 1, i) if 0 < i < len(self.tokens) else ((0, 1) if i == 0 else (-2, -1))
        if len(self.tokens) == 1:
            return self.seconds[0]
        t0, t1, s0, s1 = self.tokens[lo], self.tokens[hi], self.seconds[lo], self.seconds[hi]
        return max(s0 + (s1 - s0) * (total - t0) / (t1 - t0), 1e-9)


def choose_verify_lengths(rates: list[list[float]], step_time: StepTimeCurve) -> list[int]:
    """Drafts to verify per request, maximising expected emitted tokens per estimated step time.

    Every request always runs its golden row (1 token, expected 1 emitted). Draft pairs
    ``(request, step)`` join in descending cumulative rate (ties: lower request, then step);
    after each, expected tokens ``E`` grow by the rate and the step costs ``step_time(total)``.
    The best ``total`` wins and each request verifies its pairs among the chosen ones, which is a
    prefix of its drafts because cumulative rates never increase with the step."""
    pairs = sorted(((-rate, r, i) for r, request_rates in enumerate(rates) for i, rate in enumerate(request_rates)))
    total = expected = len(rates)
    best_rate, best_count = expected / step_time(total), 0
    for count, (negative_rate, _, _) in enumerate(pairs, start=1):
        expected -= negative_rate
        total += 1
        throughput = expected / step_time(total)
        if throughput > best_rate:
            best_rate, best_count = throughput, count
    lengths = [0] * len(rates)
    for _, r, _ in pairs[:best_count]:
        lengths[r] += 1
    return lengths


def verify_lengths_from_history(split_rates: list[list[float]], total_rates: list[list[float]],
                                step_time: StepTimeCurve) -> list[int]:
    """Drafts to verify per request from earlier rounds only: the batch verifies as many drafts
    as :func:`choose_verify_lengths` gives ``total_rates`` (each request's cumulative rates of
    two rounds back), shared out in descending ``split_rates`` (the last round's; ties: lower
    request, then step), a prefix of each request's drafts."""
    total = sum(choose_verify_lengths(total_rates, step_time))
    pairs = sorted((-rate, r, i) for r, request_rates in enumerate(split_rates) for i, rate in enumerate(request_rates))
    lengths = [0] * len(split_rates)
    for _, r, _ in pairs[:total]:
        lengths[r] += 1
    return lengths
