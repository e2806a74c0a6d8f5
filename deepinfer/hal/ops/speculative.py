"""Speculative verification: accept a draft token with probability ``min(1, q/p)``, else
resample from the residual ``max(q - alpha * p, 0)`` (row by row, counter-based RNG), in
DeepInfer 0.1.0's float32 arithmetic (the reject sampling of its ``fused_sample_ref``)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.sampling import CASE_ACCEPT, CASE_RESAMPLE, cdf_draw, draw_uniform
from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

DRAFT_LOGPROB_PENALTY = 5e-5
"""Subtracted from the draft's log-probabilities in the residual, so ``alpha = exp(-5e-5)``: it
keeps the residual from being empty, and the emitted distribution stays within ``(1 +- eps) q``
for ``eps = 1 - alpha``."""


def speculative_accept(target_logprobs: torch.Tensor, draft_logprobs: torch.Tensor, draft_ids: torch.Tensor,
                       seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one draft token per row; returns ``(accepted bool [R], resampled int64 [R])``.

    ``target_logprobs`` / ``draft_logprobs``: float ``[R, V]`` log-probabilities of the request's
    processed target distribution ``q`` and of the draft distribution ``p`` that drew the token,
    cast to float32 (DeepInfer's dtype); ``draft_ids``: int64 ``[R]`` (-1: no draft, always
    rejected); ``seeds``, ``positions``: int64 ``[R]`` (the row's draw position). Row ``r``
    accepts draft ``d`` when ``exp(min(log q(d) - log p(d), 0)) > u``, ``u`` the case-2 uniform
    (:func:`~deepinfer.hal.ops.sampling.draw_uniform`) rounded to float32; a draft of
    probability 0 under ``q`` is rejected (its ratio is 0, or NaN when ``p(d)`` is 0 too).
    ``resampled`` is :func:`~deepinfer.hal.ops.sampling.cdf_draw` (case 1) of the unnormalised
    residual ``max(exp(log q) - exp(log p - 5e-5), 0)``, or of ``q`` for a row whose residual is
    empty (never the case for two normalised distributions; DeepInfer's reference returns token
    0 there). Prefix closure across a request's rows is the caller's job."""
    check_speculative_args(target_logprobs, draft_logprobs, draft_ids, seeds, positions)
    target, draft = target_logprobs.float(), draft_logprobs.float()
    index = draft_ids.clamp(min=0)[:, None]
    ratio = (target.gather(1, index) - draft.gather(1, index))[:, 0].clamp(max=0).exp()
    accepted = (draft_ids >= 0) & (ratio > draw_uniform(seeds, positions, CASE_ACCEPT).float())
    q = target.exp()
    residual = (q - (draft - DRAFT_LOGPROB_PENALTY).exp()).clamp(min=0)
    residual = torch.where((residual.sum(dim=-1) > 0)[:, None], residual, q)
    return accepted, cdf_draw(residual, seeds, positions, CASE_RESAMPLE)


def acceptance_probability(target_logprobs: torch.Tensor, draft_logprobs: torch.Tensor) -> torch.Tensor:
    """Exact chance a draft drawn from ``p`` is accepted against ``q``: ``sum_i min(p_i, q_i)``."""
    return torch.minimum(target_logprobs.double().exp(), draft_logprobs.double().exp()).sum(dim=-1)


def check_speculative_args(target, draft, ids, seeds, positions) -> None:
    if target.dim() != 2 or target.shape != draft.shape or not target.is_floating_point():
        raise ValueError(f"target_logprobs and draft_logprobs must be float [R, V] of one shape, got "
                         f"{tuple(target.shape)} and {tuple(draft.shape)}")
    rows = target.shape[0]
    for name, tensor in (("draft_ids", ids), ("seeds", seeds), ("positions", positions)):
        if tensor.dtype != torch.int64 or tensor.shape != (rows,):
            raise ValueError(f"{name} must be int64 [R={rows}], got {tensor.dtype} {tuple(tensor.shape)}")
    if value_checks() and ids.numel() and int(ids.max()) >= target.shape[1]:
        raise ValueError(f"draft id {int(ids.max())} is outside the vocabulary of {target.shape[1]}")


def _case(rows: int, vocab: int, sharp: float, agree: float):
    """Drafts from a distribution that overlaps the target by about ``agree``."""
    def make(gen: torch.Generator, device: torch.device):
        target = sharp * torch.randn(rows, vocab, generator=gen)
        draft = agree * target + (1 - agree) * sharp * torch.randn(rows, vocab, generator=gen)
        draft_logprobs = torch.log_softmax(draft, dim=-1)
        ids = torch.multinomial(draft_logprobs.exp(), 1, generator=gen)[:, 0]
        ids[0] = -1
        return {
            "target_logprobs": torch.log_softmax(target, dim=-1).to(device),
            "draft_logprobs": draft_logprobs.to(device),
            "draft_ids": ids.to(device),
            "seeds": torch.randint(0, 1 << 62, (rows,), generator=gen).to(device),
            "positions": torch.randint(0, 1 << 20, (rows,), generator=gen).to(device),
        }
    return make


register(OpSpec(
    name="speculative_accept",
    activations=False,
    summary="accept a draft with probability min(1, q/p), else resample from max(q - alpha p, 0)",
    reference=speculative_accept,
    cases=(
        OpCase("tiny_close", _case(6, 7, 1.0, 0.9)),
        OpCase("tiny_far", _case(6, 7, 3.0, 0.0)),
        OpCase("v41_vocab", _case(6, 129280, 2.0, 0.7), size="real"),
    ),
))
