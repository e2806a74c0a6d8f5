import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.decoding.dspark import DSpark
from deepinfer.decoding.verify_schedule import (
    StepTimeCurve, VerifyCost, choose_verify_lengths, cumulative_rates, verify_lengths_from_history,
)
from tests.decoding.forced_drafts import force_rejections

QUIET = ["engine.use_tqdm=false", "engine.max_num_seqs=8"]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def _prompts(count=5, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def reference_tokens():
    llm = LLM("tiny_random", "reference", QUIET)
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("varlen", [False, True], ids=["all_drafts", "varlen"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_dspark_equals_greedy_without(reference_tokens, k, varlen):
    llm = LLM("tiny_random", "reference", QUIET + ["decoding=dspark", f"decoding.num_draft_tokens={k}",
                                            f"decoding.varlen={str(varlen).lower()}", "decoding.temperature=0"])
    outputs = llm.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens
    if not varlen:
        assert all(o.num_drafted > 0 for o in outputs)
    assert all(0 <= o.num_accepted <= o.num_drafted for o in outputs)


def test_rejections_at_every_draft_position_roll_back_exactly(reference_tokens, monkeypatch):
    """Drafts are the true continuation with one token corrupted, the corrupted position cycling
    through 0..k-1: every step rolls back at a different depth, and outputs stay exact."""
    prompts, k = _prompts(), 5
    force_rejections(monkeypatch, prompts, reference_tokens, k)
    llm = LLM("tiny_random", "reference", QUIET + ["decoding=dspark", f"decoding.num_draft_tokens={k}"])
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens
    accepted = sum(o.num_accepted for o in outputs)
    verify_steps = sum(o.num_drafted for o in outputs) // k
    assert 0 < accepted < sum(o.num_drafted for o in outputs)
    assert verify_steps > k, "every corruption depth must have been exercised"


def test_sampled_outputs_are_reproducible_and_report_metrics():
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=3, ignore_eos=True)
    llm = LLM("tiny_random", "reference", QUIET + ["decoding=dspark"])
    first = llm.generate(_prompts(3, seed=1), params)
    again = llm.generate(_prompts(3, seed=1), params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    for out in first:
        assert out.num_drafted > 0 and len(out.token_ids) == 10
        steps = out.metrics["verify_steps"]
        assert steps and out.num_drafted <= 5 * steps
        assert out.metrics["mean_accepted_length"] == pytest.approx(out.num_accepted / steps)
        assert out.num_accepted + steps <= len(out.token_ids) - 1, "each verify step emits accepted drafts + 1"
        assert 0.0 <= out.metrics["calibration_error"] <= 1.0
        assert out.num_drafted + out.metrics["clipped_drafts"] >= 5 * steps, "DeepInfer's count: 5 a verify step"
        verified, accepted = out.metrics["verified_by_draft"], out.metrics["accepted_by_draft"]
        assert sum(verified) == out.num_drafted and sum(accepted) == out.num_accepted
        assert verified[0] == steps and all(a <= v for a, v in zip(accepted, verified))
        assert accepted == sorted(accepted, reverse=True), "a draft is accepted only after the ones before it"


def test_drafts_clipped_at_the_end_are_counted():
    """Ten tokens with five drafts a step: near max_tokens the room clips the verify length; the
    clipped drafts plus the verified ones are DeepInfer's count, five for every step with drafts."""
    llm = LLM("tiny_random", "reference", QUIET + ["decoding=dspark"])
    for out in llm.generate(_prompts(3, seed=2), GREEDY):
        clipped = out.metrics["clipped_drafts"]
        assert clipped > 0
        assert (out.num_drafted + clipped) % 5 == 0 and out.num_drafted + clipped >= 5 * out.metrics["verify_steps"]


def test_too_many_drafts_for_the_ring_are_refused():
    with pytest.raises(ValueError, match="drafts at most 5 tokens at once"):
        LLM("tiny_random", "reference", QUIET + ["decoding=dspark", "decoding.num_draft_tokens=6"])


def test_cumulative_rates_multiply_confidences():
    assert cumulative_rates([0.5, 0.5, 0.8]) == pytest.approx([0.5, 0.25, 0.2])


def test_verify_lengths_maximise_tokens_per_second_by_hand():
    """Two requests; a step costs 1 s up to 4 rows, then 3 s. Rates: A [0.9, 0.8], B [0.1].
    Totals: 2 rows -> 2/1; +A0 -> 2.9/1; +A1 -> 3.7/1 (4 rows, 1 s); +B0 -> 3.8/3. Best: A gets
    2 drafts, B none."""
    curve = StepTimeCurve([1, 4, 5], [1.0, 1.0, 3.0])
    assert choose_verify_lengths([[0.9, 0.8], [0.1]], curve) == [2, 0]
    flat = StepTimeCurve([1, 2], [1.0, 1.0])
    assert choose_verify_lengths([[0.9, 0.8], [0.1]], flat) == [2, 1]
    assert choose_verify_lengths([[0.2], [0.3]], StepTimeCurve([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])) == [0, 0]


def test_step_time_curve_interpolates_and_extrapolates():
    curve = StepTimeCurve([1, 2, 4], [1.0, 2.0, 3.0])
    assert curve(3) == pytest.approx(2.5) and curve(8) == pytest.approx(5.0) and curve(2) == 2.0


CHI_PROMPT = [17, 99, 230, 5, 411, 64, 300, 12]
WRONG = torch.tensor([0.15, 0.25, 0.6])
"""A deliberately wrong draft distribution over the target's top 3 (by rank)."""


def _top3_targets(n: int, overrides: list[str]):
    """Seeded temperature-1, top-k 3 params for ``n`` requests of :data:`CHI_PROMPT`, and per seed
    the exact processed distribution of the second token (its top-3 logprobs) without DSpark."""
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, ignore_eos=True, logprobs=3)
              for s in range(n)]
    plain = LLM("tiny_random", "reference", overrides).generate([CHI_PROMPT] * n, params)
    return params, plain, {s: sorted(out.logprobs[1].items(), key=lambda kv: -kv[1])[:3] for s, out in enumerate(plain)}


def _wrong_pick(seed: int) -> int:
    """The rank (under the target) a request's first draft takes, drawn from :data:`WRONG`."""
    return int(torch.multinomial(WRONG, 1, generator=torch.Generator().manual_seed(seed)))


def _assert_first_decoded_rank_follows_target(outputs, target) -> None:
    """The first decoded token's rank under the target follows the summed target probabilities
    (chi-square, 2 degrees of freedom, p < 0.001 threshold)."""
    counts, expected = torch.zeros(3), torch.zeros(3)
    for s, out in enumerate(outputs):
        ranked = [token for token, _ in target[s]]
        counts[ranked.index(out.token_ids[1])] += 1
        expected += torch.tensor([lp for _, lp in target[s]]).exp()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.82, f"chi-square {chi2:.2f} (counts {counts.tolist()}, expected {expected.tolist()})"


def test_first_verified_token_follows_the_target_distribution_with_wrong_drafts(monkeypatch):
    """Temperature 1, top-k 3: for every seed, a run without DSpark gives the exact processed
    distribution q of the second token (its top-3 logprobs). With DSpark, drafts are drawn from a
    deliberately wrong p over the same support; the verified token's rank under q must follow
    the summed q (chi-square, 2 degrees of freedom)."""
    n = 800
    overrides = QUIET[:1] + ["engine.max_num_seqs=64", "decoding.num_draft_tokens=1"]
    params, plain, target = _top3_targets(n, overrides[:2])
    original = DSpark.receive

    def wrong_drafts(self, requests, drafted):
        original(self, requests, drafted)
        for request in (r for r in requests if r.drafts):
            support = [token for token, _ in target[request.seed]]
            logprobs = torch.full_like(request.draft_logprobs, float("-inf"))
            logprobs[0, support] = WRONG.log()
            request.drafts, request.draft_logprobs = [support[_wrong_pick(request.seed)]], logprobs

    monkeypatch.setattr(DSpark, "receive", wrong_drafts)
    drafted = LLM("tiny_random", "reference", overrides + ["decoding=dspark"]).generate([CHI_PROMPT] * n, params)
    for s, out in enumerate(drafted):
        assert out.token_ids[0] == plain[s].token_ids[0], "the prefill token does not involve drafts"
    accepted = sum(o.num_accepted for o in drafted)
    assert 0.2 * n < accepted < 0.95 * n, f"{accepted} of {n} drafts accepted: both paths must be exercised"
    _assert_first_decoded_rank_follows_target(drafted, target)


def test_verify_lengths_from_history_by_hand():
    """Two rounds back: rates A [0.9, 0.8], B [0.1] on the flat curve -> 3 drafts in all; the last
    round's rates A [0.2, 0.1], B [0.7, 0.6] share them out: B0, B1, then A0."""
    flat = StepTimeCurve([1, 2], [1.0, 1.0])
    assert verify_lengths_from_history([[0.2, 0.1], [0.7, 0.6]], [[0.9, 0.8], [0.1]], flat) == [1, 2]
    assert verify_lengths_from_history([[0.5], [0.5]], [[0.2], [0.3]],
                                       StepTimeCurve([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])) == [0, 0]


def test_varlen_verification_does_not_bias_sampling(monkeypatch):
    """Temperature 1, top-k 3, two drafts from a deliberately wrong p. The second draft's
    confidence is high only when the first draft is the token p favours, and the step-time curve
    makes verifying pay only with a high second rate: a length chosen from the judged drafts'
    own rates would verify the first draft only when it is that token, and over-emit it. The
    first decoded token's rank under the target must follow the summed target probabilities
    (chi-square, 2 degrees of freedom)."""
    n = 500
    params, _, target = _top3_targets(n, QUIET[:1] + ["engine.max_num_seqs=64"])
    original = DSpark.receive

    def rigged(self, requests, drafted):
        original(self, requests, drafted)
        for request in (r for r in requests if r.drafts):
            support = [token for token, _ in target[request.seed]]
            pick = _wrong_pick(request.seed)
            logprobs = torch.full_like(request.draft_logprobs, float("-inf"))
            logprobs[:, support] = WRONG.log()
            confidences = [0.5, 0.9 if pick == 2 else 0.1]
            request.drafts, request.draft_logprobs = [support[pick], support[0]], logprobs
            request.draft_confidences = confidences
            request.rate_history[-1] = cumulative_rates(confidences)

    monkeypatch.setattr(DSpark, "receive", rigged)
    monkeypatch.setattr(DSpark, "measure_step_time", lambda self, rows: StepTimeCurve([1, 2, 3], [1.0, 1.8, 1.8]))
    drafted = LLM("tiny_random", "reference", QUIET[:1] + [
        "engine.max_num_seqs=1", "decoding=dspark", "decoding.num_draft_tokens=2", "decoding.varlen=true",
        "decoding.verify_cost=measured",  # the rigged curve as it is
    ]).generate([CHI_PROMPT] * n, params)
    assert sum(o.num_drafted for o in drafted) > 0, "drafts must have been verified"
    _assert_first_decoded_rank_follows_target(drafted, target)


def test_per_draft_counters_by_hand():
    """Verify steps (5 verified, 2 accepted) and (3, 3): drafts 0-2 verified twice, 3-4 once;
    accepted: draft 0 and 1 twice, draft 2 once."""
    from deepinfer.engine.output_processor import request_output
    from deepinfer.engine.request import Request

    request = Request(0, None, [5], SamplingParams(), seed=0, finish_reason="length")
    request.verify_log = [(5, 2), (3, 3)]
    metrics = request_output(request).metrics
    assert metrics["verified_by_draft"] == [2, 2, 2, 1, 1] and metrics["accepted_by_draft"] == [2, 2, 1, 0, 0]


def test_deepinfers_verify_cost_by_hand():
    """Warm-up points (1, 1.5), (2, 2.0), (4, 3.0), (8, 5.0) lie on 1 + 0.5 x: 3 rows run as the
    4-row bucket, 3.0 s. Live steps of 4 rows taking 5, 3 and 9 s give slopes 1.0, 0.5 and 2.0:
    their median 1.0 prices 3 rows at 1 + 4 = 5 s."""
    cost = VerifyCost.fit(StepTimeCurve([1, 2, 4, 8], [1.5, 2.0, 3.0, 5.0]), [1, 2, 4, 8, 16])
    assert cost.baseline == pytest.approx(1.0) and cost.slope == pytest.approx(0.5)
    assert cost(3) == pytest.approx(3.0) and cost(20) == pytest.approx(11.0)
    for seconds in (5.0, 3.0, 9.0):
        cost.observe(4, seconds)
    assert cost.slope == pytest.approx(1.0) and cost(3) == pytest.approx(5.0)


def test_batch_calibration_error_is_the_mean_over_each_verifying_step(monkeypatch):
    """``metrics["batch_calibration_error"]``: for each step that verified the request's drafts,
    the mean |exact acceptance - confidence| over every draft that step verified (all requests),
    averaged over those steps; recomputed here from the emissions each step returned."""
    import deepinfer.decoding.sampler as sampler

    steps, emissions_of = [], sampler._emissions

    def spy(chunks, result, top):
        emissions = emissions_of(chunks, result, top)
        steps.append([(c.request.request_id, e.calibration_errors) for c, e in zip(chunks, emissions)])
        return emissions
    monkeypatch.setattr(sampler, "_emissions", spy)
    llm = LLM("tiny_random", "reference", QUIET + ["decoding=dspark"])
    outputs = llm.generate(_prompts(4, seed=5), SamplingParams(temperature=1.0, max_tokens=12, seed=1,
                                                               ignore_eos=True))
    for out in outputs:
        means = []
        for step in steps:
            errors = [e for _, errs in step for e in errs]
            if any(rid == out.request_id and errs for rid, errs in step):
                means.append(sum(errors) / len(errors))
        assert means and out.metrics["batch_calibration_error"] == pytest.approx(sum(means) / len(means))
