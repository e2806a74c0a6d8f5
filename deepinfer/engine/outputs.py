"""What ``LLM.generate`` returns for each request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """One finished request: generated ``text`` and ``token_ids``, ``finish_reason`` ("stop" for
    EOS, a stop token, a stop string or a completed grammar; "length" for max_tokens or
    max_model_len; "error" when the request could not run, or its structured output would break its
    grammar or JSON schema, with ``error`` saying why; "abort" for :meth:`LLM.abort` and an
    interrupted ``generate``, with the tokens emitted until then), optional per-token ``logprobs``
    ({token id: logprob}), DSpark counts (drafts verified, drafts accepted, and per verify step
    ``(verified, accepted)`` in ``verify_log``) and ``metrics``: preemptions, DSpark verify
    statistics (``clipped_drafts``: drafts not verified because the request had no room left for
    them within ``max_tokens`` or ``max_model_len``, which DeepInfer verifies and drops at the stop
    check, so that its drafted count is ``num_drafted + clipped_drafts``; per draft position ``j``,
    ``verified_by_draft[j]`` and ``accepted_by_draft[j]``: the verify steps that verified and
    accepted the ``j``-th draft; ``calibration_error``: the mean ``|exact acceptance chance -
    confidence|`` of its verified drafts, ``batch_calibration_error``: that mean over every draft
    of each step that verified its drafts, averaged over those steps, as DeepInfer's sampler
    reports the batch's), under a grammar ``structured_backend`` (the library that enforced
    it, None if it never compiled), and under a JSON schema ``structured_validation_only``: the
    schema's keywords the grammar does not enforce, checked only by validating the finished output
    (``"keyword at #/path"``)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    verify_log: list[tuple[int, int]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
