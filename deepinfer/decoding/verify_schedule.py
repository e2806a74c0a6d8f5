"""Confidence-scheduled verification: how many drafts each request verifies this step.

The choice must not depend on the drafts it judges: a draft's confidence depends on the draft
before it, so choosing by the current round's rates would verify a draft more often when it
raises the next one's rate, and bias the sampled distribution. As in DeepInfer, the batch's
total comes from the rates of two rounds back and the split between requests from the last
round's (:func:`verify_lengths_from_history`)."""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field


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


@dataclass
class VerifyCost:
    """DeepInfer's cost of a verify step of ``total`` rows: ``baseline + slope * bucket(total)``,
    where ``bucket`` is the padded size (a CUDA graph's) a step of that many rows runs as, and
    ``slope`` the median of the live estimates ``(seconds - baseline) / bucket`` of the last
    ``window`` observed steps (:meth:`observe`), seeded by a least-squares line through the
    warm-up measurement (:meth:`fit`). DeepInfer adds a sampler term; here the sampling is inside
    every measured and observed step, so the line holds it."""

    buckets: list[int]
    baseline: float
    slope: float
    window: int = 64
    estimates: deque = field(init=False)

    def __post_init__(self) -> None:
        self.estimates = deque(maxlen=self.window)

    def bucket(self, total: int) -> int:
        i = bisect.bisect_left(self.buckets, total)
        return self.buckets[i] if i < len(self.buckets) else total

    def __call__(self, total: int) -> float:
        return max(self.baseline + self.slope * self.bucket(total), 1e-9)

    def observe(self, total: int, seconds: float) -> None:
        """A step of ``total`` rows took ``seconds``: one more estimate of the slope."""
        self.estimates.append((seconds - self.baseline) / self.bucket(total))
        self.slope = max(statistics.median(self.estimates), 0.0)

    @classmethod
    def fit(cls, curve: StepTimeCurve, buckets: list[int]) -> "VerifyCost":
        """The least-squares line through ``curve``'s points, as buckets' costs."""
        xs, ys = curve.tokens, curve.seconds
        if len(xs) < 2:
            return cls(list(buckets), ys[0] if ys else 0.0, 0.0)
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread, 0.0)
        return cls(list(buckets), mean_y - slope * mean_x, slope)


def choose_verify_lengths(rates: list[list[float]], step_time: StepTimeCurve) -> list[int]:
    """Drafts to verify per request, maximising expected emitted tokens per estimated step time.

    Every request always runs its golden row (1 token, expected 1 emitted). Draft pairs
    ``(request, step)`` join in descending cumulative rate (ties: lower request, then step);
    after each, expected tokens ``E`` grow by the rate and the step costs ``step_time(total)``.
    The best ``total`` wins and each request verifies its pairs among the chosen ones, which is a
    prefix of its drafts because cumulative rates never increase with the step."""
    pairs = _ranked_pairs(rates)
    total = expected = len(rates)
    best_rate, best_count = expected / step_time(total), 0
    for count, (negative_rate, _, _) in enumerate(pairs, start=1):
        expected -= negative_rate
        total += 1
        throughput = expected / step_time(total)
        if throughput > best_rate:
            best_rate, best_count = throughput, count
    return _lengths(pairs[:best_count], len(rates))


def verify_lengths_from_history(split_rates: list[list[float]], total_rates: list[list[float]],
                                step_time: StepTimeCurve) -> list[int]:
    """Drafts to verify per request from earlier rounds only: the batch verifies as many drafts
    as :func:`choose_verify_lengths` gives ``total_rates`` (each request's cumulative rates of
    two rounds back), shared out in descending ``split_rates`` (the last round's; ties: lower
    request, then step), a prefix of each request's drafts."""
    total = sum(choose_verify_lengths(total_rates, step_time))
    return _lengths(_ranked_pairs(split_rates)[:total], len(split_rates))


def _ranked_pairs(rates: list[list[float]]) -> list[tuple[float, int, int]]:
    """``(-rate, request, step)`` of every draft, best rate first (ties: lower request, then step)."""
    return sorted((-rate, r, i) for r, request_rates in enumerate(rates) for i, rate in enumerate(request_rates))


def _lengths(pairs, requests: int) -> list[int]:
    """Drafts per request among the chosen ``pairs``."""
    lengths = [0] * requests
    for _, r, _ in pairs:
        lengths[r] += 1
    return lengths
