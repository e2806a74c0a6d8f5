"""SamplingParams: how one request's tokens are chosen and when it stops."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer.decoding.structured import check_structured

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request decoding parameters, validated on construction.

    ``temperature`` 0 is exact greedy: the first token of maximal logit (it runs through the same
    sampler, its distribution one-hot). DeepInfer samples at temperature 1e-5 instead, which picks
    the same token unless the top logits tie, where it draws one of them
    (``tests/fidelity/test_greedy.py``).
    ``top_k`` <= 0 and ``top_p`` = 1 switch those filters off. How the two combine is the
    engine's ``decoding.filter_order`` (``deepinfer.hal.ops.sampling.filter_mask``):

    * ``deepinfer`` (default, DeepInfer 0.1.0's order): rank tokens by logit, ties to the lower
      token id; top-p on the full softmax keeps every token whose preceding mass is at most
      ``top_p`` (the token crossing it stays, the first always does), then top-k keeps exactly
      the first ``top_k`` of those. E.g. p = [.5, .3, .2], ``top_p`` .6, ``top_k`` 2 keeps
      tokens 0 and 1; logits [1, 2, 2, 2, 0] with ``top_k`` 2 keep tokens 1 and 2.
    * ``vllm``: top-k keeps every token tied with the k-th logit, the rest is renormalised, and
      top-p keeps the shortest prefix whose mass reaches ``top_p`` plus every token tied with its
      last one. The first example keeps token 0 alone, the second tokens 1, 2 and 3.

    ``stop`` strings end the text
    (the stop string itself is not returned); ``stop_token_ids`` end it like EOS.
    ``min_tokens``: no end token (EOS, ``stop_token_ids``) among the first ``min_tokens`` outputs
    (DeepInfer's ``first_n_token_no_eos``); ``banned_token_ids``: tokens never emitted (its decode
    token blacklist). Both mask the target distribution, which DSpark drafts are verified
    against, so its steps run with the host in step.
    ``golden_token_ids`` (teacher forcing, DeepInfer's): the outputs are these tokens (up to
    ``max_tokens``), and a DSpark draft is accepted exactly when it is the golden token at its
    position, as if the target put all its mass there: the acceptance of a drafter on a given text.
    ``seed`` makes sampling reproducible: each draw is a pure function of (seed, draw position,
    the row's processed distribution), never of the batch. The stream is DeepInfer 0.1.0's
    PyTorch reference, bit for bit for the same distribution: the counter mix and SplitMix64 of
    ``random_sampling_ref``, its 53-bit uniform and float64 CDF inversion, its residual resample
    and acceptance test, the draw position of the token sampled (verification row ``j`` at
    ``base + j * 10000019``) and the draft namespace ``seed + 1000000007``
    (:mod:`deepinfer.hal.ops.sampling` has the rules). DeepInfer's CUDA kernel seeds TileLang's
    RNG with ``(seed, seq)`` instead, so its GPU draws are not reproduced.
    ``logprobs`` = N returns, per output token, the log-probabilities (of the processed
    distribution) of the sampled token and the N most likely ones.
    ``structured`` constrains the output to a grammar: ``{"type": "json", "schema": dict | str}``
    (``schema`` None or absent: any JSON), ``{"type": "regex", "schema": str}`` or
    ``{"type": "ebnf", "schema": str}`` (xgrammar's EBNF, with a ``root`` rule). Generation stops
    when the grammar is complete (its stop token is emitted, even with ``ignore_eos``). A grammar
    that does not compile fails its request alone (``finish_reason`` "error", message in
    ``RequestOutput.error``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    structured: dict | None = None
    min_tokens: int = 0
    banned_token_ids: list[int] = field(default_factory=list)
    golden_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.structured = check_structured(self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "banned_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple, set)):
                raise ValueError(f"{name} must be a list ({'strings' if name == 'stop' else 'token ids'}), "
                                 f"got {type(value).__name__} {value!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.banned_token_ids = list(self.banned_token_ids or [])
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (-1 or 0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.banned_token_ids):
            raise ValueError(f"banned_token_ids must be non-negative ints, got {self.banned_token_ids!r}")
        if self.golden_token_ids is not None:
            golden = self.golden_token_ids
            if not isinstance(golden, (list, tuple)) or not golden or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in golden):
                raise ValueError(f"golden_token_ids must be a non-empty list of non-negative ints, got {golden!r}")
            if self.logprobs is not None or self.structured is not None:
                raise ValueError("golden_token_ids (teacher forcing) cannot go with logprobs or structured: the forced "
                                 "rows' distribution is the golden token alone")
            self.golden_token_ids = list(golden)
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_decoding(cls, decoding) -> "SamplingParams":
        """Defaults of a ``decoding`` config group (temperature, top_p, top_k, max_tokens, seed, ignore_eos)."""
        return cls(temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                   max_tokens=decoding.max_tokens, seed=decoding.seed, ignore_eos=decoding.ignore_eos)
