import math

import numpy as np
import pytest
import torch

from deepinfer.hal.ops.sampling import CASE_SAMPLE, draw_uniform
from deepinfer.hal.ops.speculative import DRAFT_LOGPROB_PENALTY, acceptance_probability, speculative_accept
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle
from tests.hal.test_sampling import cdf_draw_python, draw_uniform_python


def speculative_accept_float64(target_logprobs, draft_logprobs, draft_ids, seeds, positions):
    accepted, resampled = [], []
    for r in range(target_logprobs.shape[0]):
        log_q, log_p = target_logprobs[r].numpy(), draft_logprobs[r].numpy()
        d, seed, pos = int(draft_ids[r]), int(seeds[r]) % (1 << 64), int(positions[r])
        u = draw_uniform_python(seed, pos, 2)
        accepted.append(d >= 0 and math.exp(min(log_q[d] - log_p[d], 0.0)) > u)
        residual = np.maximum(np.exp(log_q) - np.exp(log_p - DRAFT_LOGPROB_PENALTY), 0.0)
        residual = residual if residual.sum() > 0 else np.exp(log_q)
        resampled.append(cdf_draw_python(residual, draw_uniform_python(seed, pos, 1)))
    return torch.tensor(accepted), torch.tensor(resampled)


@pytest.mark.parametrize("case", [c.name for c in SPECS["speculative_accept"].cases])
def test_speculative_accept_matches_float64(case):
    check_against_oracle("speculative_accept", case, speculative_accept_float64)


def test_emitted_tokens_follow_the_target_even_with_wrong_drafts():
    """Draft from p, accept or resample: the emitted token is distributed as q (chi-square)."""
    q = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
    p = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5], dtype=torch.float64)
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    positions = torch.full((n,), 5, dtype=torch.int64)
    draws = draw_uniform(seeds + 123456789, positions, CASE_SAMPLE)
    drafts = torch.searchsorted(p.cumsum(0), draws[:, None])[:, 0].clamp(max=4)
    accepted, resampled = speculative_accept(q.log().float().expand(n, 5).contiguous(), p.log().float().expand(n, 5).contiguous(),
                                             drafts, seeds, positions)
    emitted = torch.where(accepted, drafts, resampled)
    counts = torch.bincount(emitted, minlength=5).double()
    chi2 = float(((counts - n * q) ** 2 / (n * q)).sum())
    assert chi2 < 18.47, f"chi-square {chi2:.2f} over 4 degrees of freedom (p < 0.001 threshold 18.47)"
    assert abs(accepted.double().mean().item() - float(acceptance_probability(q.log()[None], p.log()[None]))) < 0.02


def test_identical_distributions_always_accept_and_no_draft_always_rejects():
    logprobs = torch.log_softmax(torch.randn(16, 9, generator=torch.Generator().manual_seed(1)), dim=-1)
    ids = torch.arange(16) % 9
    ids[3] = -1
    accepted, _ = speculative_accept(logprobs, logprobs, ids, torch.arange(16), torch.arange(16))
    assert accepted.tolist() == [i != 3 for i in range(16)]


def test_greedy_one_hot_rejects_a_wrong_draft_and_resamples_the_target_argmax():
    q = torch.full((1, 6), -math.inf)
    q[0, 4] = 0.0
    p = torch.full((1, 6), -math.inf)
    p[0, 2] = 0.0
    accepted, resampled = speculative_accept(q, p, torch.tensor([2]), torch.tensor([9]), torch.tensor([3]))
    assert not accepted.item() and resampled.item() == 4
