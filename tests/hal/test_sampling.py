import math

import numpy as np
import pytest
import torch

from deepinfer.hal.ops.sampling import (
    CASE_ACCEPT, CASE_RESAMPLE, CASE_SAMPLE, SEED_NAMESPACE_DRAFT, SEED_NAMESPACE_TARGET, draw_uniform, sample,
)
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle

MASK64 = (1 << 64) - 1


def draw_uniform_python(seed: int, position: int, case: int) -> float:
    """The counter RNG in Python integers, reduced mod 2**64 after every step: the state is
    ``seed ^ m`` (acceptance, case 2) or ``seed + (m ^ (m << 13))`` with ``m = (3p + case) * golden``."""
    golden = 0x9E3779B97F4A7C15
    m = ((3 * position + case) * golden) & MASK64
    state = (seed ^ m) if case == CASE_ACCEPT else (seed + (m ^ ((m << 13) & MASK64))) & MASK64
    z = (state + golden) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) / 2.0 ** 53


def _first_ranks_kept(z, top_p, top_k):
    """DeepInfer's order: the first min(n_p, k) tokens by (z descending, index ascending), n_p
    counting the tokens whose preceding mass of the full softmax is at most top_p."""
    order = np.argsort(-z, kind="stable")
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    preceding = np.concatenate(([0.0], np.cumsum(probs[order])[:-1]))
    kept = int((preceding <= top_p).sum()) if top_p < 1.0 else z.size
    if 0 < top_k < z.size:
        kept = min(kept, top_k)
    keep = np.zeros(z.size, dtype=bool)
    keep[order[:kept]] = True
    return keep


def _processed_logprobs(logits, temperature, top_p, top_k, filter_order):
    if temperature == 0:
        first_max = int(np.argmax(logits))
        return np.where(np.arange(logits.size) == first_max, 0.0, -np.inf)
    z = logits / max(temperature, 1e-5)
    if filter_order == "deepinfer":
        keep = _first_ranks_kept(z, top_p, top_k)
        log_total = math.log(np.exp(z[keep] - z[keep].max()).sum()) + z[keep].max()
        return np.where(keep, z - log_total, -np.inf)
    keep = np.ones(z.size, dtype=bool)
    if 0 < top_k < z.size:
        keep = z >= np.sort(z)[::-1][top_k - 1]
    probs = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        running, threshold = 0.0, 0.0
        for p in sorted(probs, reverse=True):
            running, threshold = running + p, p
            if running >= top_p:
                break
        keep &= probs >= threshold
    log_total = math.log(np.exp(z[keep] - z[keep].max()).sum()) + z[keep].max()
    return np.where(keep, z - log_total, -np.inf)


def cdf_draw_python(probs, uniform) -> int:
    """The first token whose float64 prefix sum (left to right) exceeds ``uniform * total``."""
    cumulative, running = [], 0.0
    for p in probs:
        running += float(p)
        cumulative.append(running)
    target = uniform * running
    return next((i for i, c in enumerate(cumulative) if c > target), 0)


def sample_float64(logits, temperature, top_p, top_k, seeds, positions, case=0, filter_order="deepinfer"):
    tokens, rows = [], []
    for i in range(logits.shape[0]):
        logprobs = _processed_logprobs(logits[i].numpy(), temperature[i].item(), top_p[i].item(), top_k[i].item(),
                                       filter_order)
        uniform = draw_uniform_python(seeds[i].item() % (1 << 64), positions[i].item(), case)
        tokens.append(cdf_draw_python(np.exp(logprobs), uniform))
        rows.append(logprobs)
    return torch.tensor(tokens), torch.from_numpy(np.stack(rows))


def _args(logits, temperature=1.0, top_p=1.0, top_k=0, seed=7, positions=None):
    rows = logits.shape[0]
    return {"logits": logits, "temperature": torch.full((rows,), float(temperature)),
            "top_p": torch.full((rows,), float(top_p)), "top_k": torch.full((rows,), top_k),
            "seeds": torch.full((rows,), seed),
            "positions": torch.arange(rows) if positions is None else positions}


@pytest.mark.parametrize("case", [c.name for c in SPECS["sample"].cases])
def test_sample_matches_float64(case):
    check_against_oracle("sample", case, sample_float64)


@pytest.mark.parametrize("case", [CASE_SAMPLE, CASE_RESAMPLE, CASE_ACCEPT])
def test_draw_uniform_matches_python_integers(case):
    rng = np.random.default_rng(case)
    odd_seeds = rng.integers(0, 1 << 63, 200, dtype=np.uint64) * 2 + 1
    seeds = [0, 1, (1 << 63) - 1, 1 << 63, MASK64] + [int(s) for s in odd_seeds]
    positions = [0, 1, 10000019, (1 << 60) + 5, 12345] + [int(c) for c in rng.integers(0, 1 << 60, 200)]
    as_int64 = [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]
    got = draw_uniform(torch.tensor(as_int64), torch.tensor(positions), case)
    assert got.dtype == torch.float64
    assert got.tolist() == [draw_uniform_python(s, p, case) for s, p in zip(seeds, positions)]
    assert bool(((got >= 0) & (got < 1)).all())


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 1000, generator=gen)
    args = _args(logits, temperature=0.0, seed=11)
    args["seeds"] = torch.randint(-(1 << 62), 1 << 62, (64,), generator=gen)
    tokens, logprobs = sample(**args)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.equal(logprobs.argmax(dim=-1), tokens)
    assert bool((logprobs.exp().sum(dim=-1) == 1).all()), "a greedy row's distribution is exactly one-hot"


def test_greedy_ties_take_the_first_maximal_token():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]] * 8)
    args = _args(logits, temperature=0.0)
    args["seeds"] = torch.arange(8)
    tokens, _ = sample(**args)
    assert tokens.tolist() == [1] * 8


def test_token_does_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(6)
    args = _args(torch.randn(8, 500, generator=gen), temperature=1.0, top_p=0.9, top_k=100,
                 positions=torch.randint(0, 1 << 30, (8,), generator=gen))
    args["seeds"] = torch.randint(0, 1 << 62, (8,), generator=gen)
    tokens, _ = sample(**args)
    order = torch.randperm(8, generator=gen)
    permuted, _ = sample(**{k: v[order] for k, v in args.items()})
    assert torch.equal(permuted, tokens[order])
    alone, _ = sample(**{k: v[3:4] for k, v in args.items()})
    assert alone.item() == tokens[3].item()


@pytest.mark.parametrize("case", [CASE_SAMPLE, CASE_RESAMPLE, CASE_ACCEPT])
def test_two_equal_tokens_split_at_one_half_of_the_uniform(case):
    positions = torch.arange(200) * 977
    tokens, _ = sample(**_args(torch.zeros(200, 2), seed=-3, positions=positions), case=case)
    uniforms = [draw_uniform_python(MASK64 - 2, p, case) for p in positions.tolist()]
    assert tokens.tolist() == [int(u >= 0.5) for u in uniforms]


def _seed_for_output(z: int, position: int) -> int:
    """The seed whose case-0 SplitMix64 output at ``position`` is ``z``, by inverting each step."""
    def unshift(y, bits):
        x = y
        for _ in range(64 // bits):
            x = y ^ (x >> bits)
        return x

    z = unshift(z, 31)
    z = unshift(z * pow(0x94D049BB133111EB, -1, 1 << 64) & MASK64, 27)
    z = unshift(z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64) & MASK64, 30)
    state = (z - 0x9E3779B97F4A7C15) & MASK64
    m = (3 * position * 0x9E3779B97F4A7C15) & MASK64
    seed = (state - (m ^ ((m << 13) & MASK64))) & MASK64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@pytest.mark.parametrize("output, token", [(0, 1), (MASK64, 2)])
def test_extreme_uniforms_never_pick_zero_probability_tokens(output, token):
    seed = _seed_for_output(output, position=9)
    assert draw_uniform_python(seed % (1 << 64), 9, CASE_SAMPLE) == (0.0 if output == 0 else 1 - 2.0 ** -53)
    # top-k keeps tokens 1 and 2; tokens 0 and 3 have probability 0 and sit at both ends of the CDF
    args = _args(torch.tensor([[0.0, 5.0, 5.0, 0.0]]), top_k=2, seed=seed, positions=torch.tensor([9]))
    assert sample(**args)[0].tolist() == [token]


def test_draw_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 20000
    tokens, _ = sample(**_args(probs.log().expand(draws, 4).contiguous(), seed=12345))
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001


def test_top_k_keeps_exactly_k_in_deepinfer_order_by_hand():
    # logits [3, 2, 2, 1], k = 2: ranks 3 (token 0), then the tie at 2 goes to the lower id, token 1
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    _, logprobs = sample(**_args(logits, top_k=2))
    log_total = 2 + math.log(math.e + 1)  # log(e^3 + e^2)
    want = torch.tensor([[3 - log_total, 2 - log_total, -math.inf, -math.inf]])
    assert torch.allclose(logprobs, want, atol=1e-6)


def test_top_k_keeps_ties_at_the_threshold_in_vllm_order_by_hand():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    _, logprobs = sample(**_args(logits, top_k=2), filter_order="vllm")
    log_total = 2 + math.log(math.e + 2)  # log(e^3 + 2 e^2)
    want = torch.tensor([[3 - log_total, 2 - log_total, 2 - log_total, -math.inf]])
    assert torch.allclose(logprobs, want, atol=1e-6)


@pytest.mark.parametrize("filter_order", ["deepinfer", "vllm"])
@pytest.mark.parametrize("probs, top_p, kept", [
    ([0.1, 0.5, 0.15, 0.25], 0.45, 1), ([0.1, 0.5, 0.15, 0.25], 0.7, 2), ([0.1, 0.5, 0.15, 0.25], 0.8, 3),
    ([0.1, 0.5, 0.15, 0.25], 0.95, 4), ([0.1, 0.5, 0.15, 0.25], 1.0, 4),
    ([0.004, 0.5, 0.196, 0.3], 0.995, 3), ([0.004, 0.5, 0.196, 0.3], 1.0, 4),
])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass_by_hand(probs, top_p, kept, filter_order):
    # away from exact ties and exact boundaries the two orders agree on top-p alone
    _, logprobs = sample(**_args(torch.tensor([probs]).log(), top_p=top_p), filter_order=filter_order)
    by_mass = sorted(range(4), key=lambda i: -probs[i])
    assert (logprobs[0, by_mass[:kept]] > -math.inf).all() and (logprobs[0, by_mass[kept:]] == -math.inf).all()
    assert torch.allclose(logprobs.exp().sum(), torch.tensor(1.0))


@pytest.mark.parametrize("filter_order, kept", [("deepinfer", [0, 1]), ("vllm", [0, 1, 2, 3])])
def test_top_p_ties_with_the_threshold_token(filter_order, kept):
    # [0.4, 0.2, 0.2, 0.2], top_p 0.5: token 1 crosses it; deepinfer stops there (tokens 2 and 3
    # have 0.6 and 0.8 before them), vllm keeps every token tied with it
    _, logprobs = sample(**_args(torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log(), top_p=0.5), filter_order=filter_order)
    assert torch.isfinite(logprobs[0]).nonzero()[:, 0].tolist() == kept


@pytest.mark.parametrize("filter_order, kept", [("deepinfer", [0, 1, 2]), ("vllm", [0, 1])])
def test_a_token_whose_preceding_mass_equals_top_p(filter_order, kept):
    # [1/2, 1/4, 1/8, 1/8] (exact in float32), top_p 3/4: token 2 has exactly 3/4 before it;
    # deepinfer keeps it (preceding mass <= top_p) and not its tie, token 3 (7/8 before it);
    # vllm stops at the shortest prefix reaching 3/4
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    assert torch.softmax(logits, dim=-1).tolist() == [[0.5, 0.25, 0.125, 0.125]]
    _, logprobs = sample(**_args(logits, top_p=0.75), filter_order=filter_order)
    assert torch.isfinite(logprobs[0]).nonzero()[:, 0].tolist() == kept


def test_an_unknown_filter_order_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="filter_order='topk_first' is not a filter order; use one of "
                                         "\\['deepinfer', 'vllm'\\]"):
        sample(**_args(torch.zeros(1, 4)), filter_order="topk_first")


@pytest.mark.parametrize("name, value, match", [
    ("temperature", torch.tensor([-0.5]), "temperature must be >= 0"),
    ("top_p", torch.tensor([0.0]), "top_p must lie in \\(0, 1\\]"),
    ("top_p", torch.tensor([1.5]), "top_p must lie in \\(0, 1\\]"),
    ("top_k", torch.tensor([1.0]), "top_k must be an int64 tensor of shape \\[N=1\\], got torch.float32"),
    ("seeds", torch.tensor([1, 2]), "seeds must be an int64 tensor of shape \\[N=1\\]"),
    ("positions", torch.tensor([1], dtype=torch.int32), "positions must be an int64 tensor"),
    ("logits", torch.zeros(3), "logits must be a float \\[N, V\\] tensor"),
])
def test_bad_arguments_are_rejected(name, value, match):
    args = _args(torch.zeros(1, 4))
    args[name] = value
    with pytest.raises(ValueError, match=match):
        sample(**args)


def test_unknown_case_is_rejected():
    with pytest.raises(ValueError, match="case must be 0 \\(sample\\), 1 \\(resample\\) or 2 \\(accept\\), got 3"):
        sample(**_args(torch.zeros(1, 4)), case=3)


@pytest.mark.parametrize("case", [CASE_SAMPLE, CASE_RESAMPLE])
def test_draft_namespace_adds_its_offset_to_the_seed_mod_2_64(case):
    seeds = [0, 5, (1 << 63) - 3, MASK64 - 7, MASK64]
    positions = torch.arange(len(seeds) * 40) * 131
    row_seeds = [seeds[i % len(seeds)] for i in range(positions.numel())]
    args = _args(torch.zeros(positions.numel(), 2), positions=positions)
    args["seeds"] = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in row_seeds])
    tokens, _ = sample(**args, case=case, namespace=SEED_NAMESPACE_DRAFT)
    uniforms = [draw_uniform_python((s + 1_000_000_007) & MASK64, p, case)
                for s, p in zip(row_seeds, positions.tolist())]
    assert tokens.tolist() == [int(u >= 0.5) for u in uniforms]
    target, _ = sample(**args, case=case)
    assert torch.equal(target, sample(**args, case=case, namespace=SEED_NAMESPACE_TARGET)[0])
    assert not torch.equal(target, tokens), "draft draws must not reuse the target draws"


def test_bad_namespace_is_rejected():
    with pytest.raises(ValueError, match="namespace must be an int in \\[0, 2\\*\\*64\\)"):
        sample(**_args(torch.zeros(1, 4)), namespace=-1)


def test_thresholds_and_ties_are_per_row_at_the_v41_vocab():
    """Tied logits, top-k, top-p and greedy rows: each row's token and distribution are the same
    alone, in the batch and in any order."""
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 5, 129280
    args = {"logits": torch.randint(0, 4, (rows, vocab), generator=gen).float(),
            "temperature": torch.tensor([1.0, 0.7, 0.0, 1.3, 2.0]),
            "top_p": torch.tensor([1.0, 0.9, 1.0, 0.5, 0.3]),
            "top_k": torch.tensor([0, 1000, -1, 50, 3]),
            "seeds": torch.randint(0, 1 << 62, (rows,), generator=gen),
            "positions": torch.randint(0, 1 << 20, (rows,), generator=gen)}
    tokens, logprobs = sample(**args)
    order = torch.randperm(rows, generator=gen)
    permuted, permuted_logprobs = sample(**{k: v[order] for k, v in args.items()})
    assert torch.equal(permuted, tokens[order]) and torch.equal(permuted_logprobs, logprobs[order])
    for i in range(rows):
        alone, alone_logprobs = sample(**{k: v[i:i + 1] for k, v in args.items()})
        assert alone.item() == tokens[i].item() and torch.equal(alone_logprobs[0], logprobs[i]), f"row {i}"


def test_skipping_the_filters_matches_the_oracle_when_no_sampled_row_uses_them():
    """``filters=False``: greedy rows may carry any top-k/top-p (greedy ignores them), sampled rows
    have both off; tokens and log-probabilities are the float64 oracle's."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    temperature = torch.tensor([0.0, 0.7, 0.0, 1.3, 1.0, 0.0])
    top_p = torch.tensor([0.5, 1.0, 0.9, 1.0, 1.0, 1.0])
    top_k = torch.tensor([3, 0, -1, 50, -1, 7])
    seeds, positions = torch.arange(6) + 11, torch.arange(6) * 5
    tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, positions, filters=False)
    want_tokens, want_logprobs = sample_float64(logits.double(), temperature, top_p, top_k, seeds, positions)
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs.double(), want_logprobs, atol=1e-5, rtol=1e-5)
