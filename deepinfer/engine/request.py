"""A request's life in the engine: its tokens, cache resources and stop state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer.engine.sampling_params import SamplingParams


PLACEHOLDER = -1
"""Stands for a token a launched step is still sampling; the device fills it in."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """``num_computed`` tokens of ``token_ids`` (prompt then outputs) have their KV in the cache.
    A preempted request keeps its outputs and recomputes its KV when it runs again. With DSpark,
    ``drafts`` (with their distributions and confidences) wait for the next step, which verifies
    ``verify_drafts``, a prefix of them. ``grammar`` (structured outputs) holds the compile state
    and matcher; ``error`` says why a request finished with reason "error"; ``num_retries``: how
    often a structured output its schema rejected was generated again. ``inflight``: tokens
    launched steps are sampling for it, not yet known on the host (each a :data:`PLACEHOLDER`
    at the end of ``token_ids``). ``unconfirmed``: drafts a launched step verifies, which count
    as computed once it is collected (up to that many more tokens than ``num_computed``);
    ``pending_drafts``: drafts a launched step proposes, on the device until it is collected;
    ``replay_length``: the tokens bounded replay counts as the prompt (None: the prompt; DeepInfer's
    scheduler sets prompt plus outputs when it preempts the request);
    ``rate_history``: the cumulative confidence rates of the last draft rounds received, newest
    last (varlen verification chooses from the earlier ones). ``force_topk`` (> 0) caps the
    tokens every draw of the request keeps (:attr:`top_k`); ``batch_calibration_errors``: for
    each step that verified its drafts, the mean calibration error of every draft that step
    verified (the whole batch's)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    status: Status = Status.WAITING
    num_computed: int = 0
    state_slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    detokenizer: object | None = None
    drafts: list[int] = field(default_factory=list)
    draft_logprobs: object | None = None
    draft_confidences: list[float] = field(default_factory=list)
    rate_history: list[list[float]] = field(default_factory=list)
    verify_drafts: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    num_clipped_drafts: int = 0
    replay_length: int | None = None
    calibration_errors: list[float] = field(default_factory=list)
    batch_calibration_errors: list[float] = field(default_factory=list)
    verify_log: list[tuple[int, int]] = field(default_factory=list)
    grammar: object | None = None
    error: str | None = None
    inflight: int = 0
    unconfirmed: int = 0
    pending_drafts: int = 0
    num_retries: int = 0
    force_topk: int = 0

    @property
    def top_k(self) -> int:
        """The top-k its draws filter with: ``params.top_k``, capped at ``force_topk`` when that is
        set (a ``top_k`` of -1 or 0, which keeps every token, becomes ``force_topk``)."""
        top_k = self.params.top_k
        if self.force_topk <= 0:
            return top_k
        return self.force_topk if top_k <= 0 else min(top_k, self.force_topk)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids + [PLACEHOLDER] * self.inflight

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.inflight

    @property
    def num_pending(self) -> int:
        """Tokens still to be run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
