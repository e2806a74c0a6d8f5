"""What ``LLM.generate`` returns for each request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One finished request: generated ``text`` and ``token_ids``, ``finish_reason`` ("stop" for
    EOS, a stop token, a stop string or a completed grammar; "length" for max_tokens or
    max_model_len; "error" when the request could not run, or its structured output would break
    its grammar or JSON schema, with ``error`` saying why), optional
    per-token ``logprobs`` ({token id: logprob}), and DSpark counts: drafts verified, drafts
    accepted, and per verify step ``(verified, accepted)`` in ``verify_log``."""

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
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
