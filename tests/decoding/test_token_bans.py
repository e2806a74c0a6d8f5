"""``min_tokens`` (DeepInfer's first_n_token_no_eos) and ``banned_token_ids`` (its decode token
blacklist): masks worked by hand, and the engine never emits what they ban, with and without
DSpark drafts."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.decoding.step_masks import step_masks
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Chunk

QUIET = ["engine.use_tqdm=false"]


def _chunk(params, outputs=(), drafts=()):
    request = Request(0, None, [5, 6], params, seed=0)
    request.output_token_ids = list(outputs)
    return Chunk(request, [6, *drafts], 1, True, list(drafts), 1, (1,))


def _allowed(bitmask_row, token):
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def test_end_tokens_are_banned_until_min_tokens_outputs_by_hand():
    """Two outputs emitted, min_tokens 4, two drafts: rows 0 and 1 emit outputs 2 and 3 (EOS 1
    and stop token 40 banned), row 2 emits output 4 (free); token 70 is banned everywhere."""
    params = SamplingParams(min_tokens=4, stop_token_ids=[40], banned_token_ids=[70])
    bitmask, rows = step_masks([_chunk(params, outputs=[9, 9], drafts=[11, 12])], 100, eos_token_ids=[1])
    assert rows.tolist() == [0, 1, 2]
    assert [_allowed(bitmask[r], 1) for r in range(3)] == [False, False, True]
    assert [_allowed(bitmask[r], 40) for r in range(3)] == [False, False, True]
    assert not any(_allowed(bitmask[r], 70) for r in range(3))
    assert all(_allowed(bitmask[r], 71) and _allowed(bitmask[r], 0) for r in range(3))


def test_no_bans_means_no_masks():
    assert step_masks([_chunk(SamplingParams(min_tokens=2), outputs=[3, 4])], 100, eos_token_ids=[1]) is None


@pytest.mark.parametrize("overrides", [[], ["decoding=dspark"], ["engine.async_scheduling=true", "engine.cuda_graphs=true"]],
                         ids=["plain", "dspark", "async"])
def test_the_engine_never_emits_a_banned_token(overrides):
    llm = LLM("tiny_random", "reference", QUIET + overrides)
    prompts = [[17, 99, 230, 5], [300, 12, 8]]
    free = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    common = sorted({t for tokens in free for t in tokens})[:3]
    banned = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                  banned_token_ids=common))
    assert all(not set(o.token_ids) & set(common) for o in banned)
    assert all(len(o.token_ids) == 10 for o in banned)
    sampled = llm.generate(prompts * 4, SamplingParams(temperature=1.5, max_tokens=6, seed=3, ignore_eos=True,
                                                       banned_token_ids=common))
    assert all(not set(o.token_ids) & set(common) for o in sampled)


def test_min_tokens_holds_off_the_end_token():
    """A stop token the greedy run emits at once: with min_tokens 5 it cannot end the output
    before 5 tokens."""
    llm = LLM("tiny_random", "reference", QUIET)
    prompt = [17, 99, 230, 5]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=5))[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:4]


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="min_tokens must be an int >= 0, got -1"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="banned_token_ids must be non-negative ints"):
        SamplingParams(banned_token_ids=[-3])
    llm = LLM("tiny_random", "reference", QUIET)
    with pytest.raises(ValueError, match="banned_token_ids holds 600, outside the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(banned_token_ids=[600]))
