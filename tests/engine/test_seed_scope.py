"""Seeds of requests whose SamplingParams give none: one per request (ours) or one per
SamplingParams object (DeepInfer's, ``engine.seed_scope=sampling_params``)."""
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import ConfigError

QUIET = ["engine.use_tqdm=false"]
PROMPT = [17, 99, 230, 5]


def _tokens(llm, params_list):
    return [o.token_ids for o in llm.generate([PROMPT] * len(params_list), params_list)]


def test_each_unseeded_request_draws_its_own_seed_by_default():
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = _tokens(LLM("tiny_random", "reference", QUIET), [params] * 4)
    assert len({tuple(r) for r in runs}) > 1


def test_requests_of_one_sampling_params_share_a_seed_under_deepinfers_scope():
    # batch-invariant ops: the one request alone must see the logits it saw among four
    llm = LLM("tiny_random", "reference", QUIET + ["engine.seed_scope=sampling_params", "engine.batch_invariant=true"])
    shared = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = _tokens(llm, [shared] * 4)
    assert len({tuple(r) for r in runs}) == 1, "one SamplingParams: one seed, identical samples"
    assert _tokens(llm, [shared]) == runs[:1], "the object keeps its seed across calls"
    others = _tokens(llm, [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True) for _ in range(4)])
    assert len({tuple(r) for r in others}) > 1, "equal but distinct objects draw distinct seeds"


def test_an_unknown_seed_scope_is_refused():
    with pytest.raises(ConfigError, match="engine.seed_scope"):
        LLM("tiny_random", "reference", QUIET + ["engine.seed_scope=batch"])
