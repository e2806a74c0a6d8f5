"""The narrow interface the engine drives a model through.

The engine, its runner, the KV manager and DSpark use only what a model declares here: the page
size of its paged caches, cache allocation and sizing, the forward pass and the draft pass.
A new architecture implements this protocol and registers in :mod:`deepinfer.models.registry`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepinfer.models.forward_context import ForwardContext


@dataclass
class DraftSampling:
    """How a draft pass samples, one entry per sequence (device tensors): ``temperature``,
    ``top_p``, ``top_k``, ``seeds`` (the requests' own), ``confidence_temperature`` (the
    confidence head's: one, or one per draft step), and ``filter_order`` (``decoding.filter_order``: how top-p and top-k
    combine in the distributions drafts are drawn from)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seeds: torch.Tensor
    confidence_temperature: float | tuple[float, ...]
    filter_order: str = "deepinfer"


@dataclass
class DraftProposal:
    """A draft pass's result per sequence: ``tokens int64 [B, k]``, the distributions they were
    drawn from ``logprobs float32 [B, k, V]``, and the estimated acceptance chances
    ``confidences float32 [B, k]``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    confidences: torch.Tensor


class GenerativeModel(Protocol):
    """What the engine needs of a model.

    ``page_tokens``: tokens per paged cache block. ``vocab_size``. ``max_model_len``: the
    longest sequence served; positions up to ``max_model_len + position_margin`` must be
    computable (speculative rows past the end are computed, then dropped). ``max_draft_tokens``:
    the most draft tokens a draft pass may propose (0: no drafter). ``draft_noise_token``: the
    token filling a draft block after its first row."""

    page_tokens: int
    vocab_size: int
    max_model_len: int
    position_margin: int
    max_draft_tokens: int
    draft_noise_token: int

    def allocate_caches(self, num_blocks: int, num_state_slots: int) -> Any:
        """Caches of ``num_blocks`` paged blocks and ``num_state_slots`` per-sequence slots."""

    def cache_bytes(self, num_blocks: int, num_state_slots: int) -> int:
        """Bytes :meth:`allocate_caches` takes for these counts."""

    def check_bounded_replay(self, keep_tokens: int) -> None:
        """Refuse a bounded-replay ``keep_tokens`` the model cannot honour, saying why."""

    def __call__(self, ctx: ForwardContext, caches: Any) -> torch.Tensor:
        """float32 logits of the rows ``ctx.logits_indices``."""

    def draft(self, ctx: ForwardContext, caches: Any, sampling: DraftSampling) -> DraftProposal:
        """One draft pass over each sequence's block ``[last token, noise, ...]`` (a decode
        context with ``draft_block`` set), sampled token by token."""
