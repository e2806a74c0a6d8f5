"""Speculative verification: accept a draft token with probability ``min(1, q/p)``, else
resample from the residual ``max(q - alpha * p, 0)`` (row by row, counter-based RNG)."""
from __future__ import annotations

import math

import torch

from deepinfer.hal.ops.sampling import CASE_ACCEPT, CASE_RESAMPLE, counter_uniform, fixed_point_draw
from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

DRAFT_PROB_PENALTY = math.exp(-5e-5)
"""``alpha``: shrinks the draft distribution in the residual so it is never empty; the emitted
distribution then stays within ``(1 +- eps) q`` for ``eps = 1 - alpha``."""


def speculative_accept(target_logprobs: torch.Tensor, draft_logprobs: torch.Tensor, draft_ids: torch.Tensor,
                       seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one draft token per row; returns ``(accepted bool [R], resampled int64 [R])``.

    ``target_logprobs`` / ``draft_logprobs``: float ``[R, V]`` log-probabilities of the request's
    processed target distribution ``q`` and of the draft distribution ``p`` the token was drawn
    from; ``draft_ids``: int64 ``[R]`` (-1: no draft, always rejected); ``seeds``, ``positions``:
    int64 ``[R]`` (the position of the token the row emits). Row ``r`` accepts when
    ``u < min(1, q(d) / p(d))`` with ``u = counter_uniform(seed, 3 * position + 2)``;
    ``resampled`` is drawn (case 1) from ``max(q - alpha * p, 0)`` renormalised, or from ``q``
    when that residual is empty. Prefix closure across a request's rows is the caller's job."""
    check_speculative_args(target_logprobs, draft_logprobs, draft_ids, seeds, positions)
    q = target_logprobs.double().exp()
    p = draft_logprobs.double().exp()
    index = draft_ids.clamp(min=0)[:, None]
    q_draft, p_draft = q.gather(1, index)[:, 0], p.gather(1, index)[:, 0]
    ratio = torch.where(p_draft > 0, q_draft / p_draft.clamp(min=torch.finfo(torch.float64).tiny),
                        torch.where(q_draft > 0, math.inf, 0.0))
    uniform = counter_uniform(seeds, 3 * positions + CASE_ACCEPT)
    accepted = (draft_ids >= 0) & (uniform < ratio.clamp(max=1.0))
    residual = (q - DRAFT_PROB_PENALTY * p).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(torch.float64).tiny), q)
    return accepted, fixed_point_draw(residual, seeds, positions, CASE_RESAMPLE)


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
