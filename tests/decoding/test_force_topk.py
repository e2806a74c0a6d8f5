"""``decoding.force_topk`` (DeepInfer's sampler force-top-k): every draw keeps at most that many
tokens, so force_topk=1 samples the argmax (greedy outputs at any temperature, with and without
DSpark), and a request's own top_k above it is capped while one below it stays."""
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request

QUIET = ["engine.use_tqdm=false", "engine.max_num_seqs=4"]


def _prompts(count=4, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(count)]


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(_prompts(), params)]


@pytest.mark.parametrize("decoding", [[], ["decoding=dspark"]], ids=["plain", "dspark"])
def test_force_topk_of_one_samples_the_argmax(decoding):
    greedy = _tokens(LLM("tiny_random", "reference", QUIET),
                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    forced = LLM("tiny_random", "reference", QUIET + decoding + ["decoding.force_topk=1"])
    assert _tokens(forced, SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=4)) == greedy


def test_force_topk_caps_a_larger_top_k_and_keeps_a_smaller_one():
    seeded = dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=9)
    plain = LLM("tiny_random", "reference", QUIET)
    forced = LLM("tiny_random", "reference", QUIET + ["decoding.force_topk=5"])
    assert _tokens(forced, SamplingParams(top_k=-1, **seeded)) == _tokens(plain, SamplingParams(top_k=5, **seeded))
    assert _tokens(forced, SamplingParams(top_k=50, **seeded)) == _tokens(plain, SamplingParams(top_k=5, **seeded))
    assert _tokens(forced, SamplingParams(top_k=3, **seeded)) == _tokens(plain, SamplingParams(top_k=3, **seeded))


@pytest.mark.parametrize("top_k, force, want", [(-1, 0, -1), (7, 0, 7), (-1, 16, 16), (0, 16, 16), (40, 16, 16),
                                                (3, 16, 3)])
def test_request_top_k(top_k, force, want):
    request = Request(0, None, [5], SamplingParams(top_k=top_k), seed=0, force_topk=force)
    assert request.top_k == want


def test_a_negative_force_topk_is_refused():
    with pytest.raises(Exception, match="decoding.force_topk"):
        LLM("tiny_random", "reference", QUIET + ["decoding.force_topk=-1"])
