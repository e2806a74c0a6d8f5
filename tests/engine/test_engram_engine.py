"""Engram in the engine (reference backend, one process): continuous batching with chunked
prefill, preemption by recompute and DSpark rollbacks at every depth all give the tokens of a
plain run, since each row's n-gram history is rebuilt from the sequence's own steps."""
import random
from types import SimpleNamespace

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import ConfigError
from tests.decoding.forced_drafts import force_rejections
from tests.models.tiny_model import ENGRAM

ENGRAM_OVERRIDES = [f"+model.config.{key}={value}".replace(" ", "") for key, value in ENGRAM.items()]
QUIET = ["engine.use_tqdm=false", "model.max_model_len=256"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(*overrides: str) -> LLM:
    return LLM("tiny_random", "reference", QUIET + ENGRAM_OVERRIDES + list(overrides))


def _prompts(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def plain():
    llm = _llm()
    assert llm.model.engram_index is not None
    return llm


@pytest.fixture(scope="module")
def plain_run(plain):
    prompts = _prompts((5, 40, 100, 126))
    return prompts, [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_chunked_prefill_and_batching_give_the_plain_tokens(plain_run):
    prompts, want = plain_run
    batched = _llm("engine.max_num_batched_tokens=24", "engine.prefill_chunk_tokens=8")
    assert [o.token_ids for o in batched.generate(prompts, GREEDY)] == want


def test_preemption_by_recompute_gives_the_plain_tokens(plain):
    """Three usable blocks of 128 tokens for three requests that each grow past one block."""
    prompts = _prompts((122, 124, 126), seed=1)
    tight = _llm("engine.num_kv_blocks=4", "engine.max_num_seqs=3")
    outputs = tight.generate(prompts, GREEDY)
    assert tight.scheduler.num_preemptions > 0, "the cache budget did not force a preemption"
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_dspark_rollbacks_at_every_depth_give_the_plain_tokens(plain_run, monkeypatch):
    prompts, want = plain_run
    k = 3
    steps = force_rejections(monkeypatch, prompts, want, k)
    outputs = _llm("decoding=dspark", f"decoding.num_draft_tokens={k}").generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == want
    assert 0 < sum(o.num_accepted for o in outputs) < sum(o.num_drafted for o in outputs)
    assert steps["n"] > k


def test_verify_steps_launched_before_the_last_is_collected_give_the_plain_tokens(plain, monkeypatch):
    """Asynchronous scheduling with padded passes: a verify step's start and tokens are read on
    the device from the step still in flight, and so is the history its rows hash."""
    prompts, params = _prompts((5, 40, 100)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = _llm("decoding=dspark", "decoding.num_draft_tokens=3", "decoding.varlen=false", "engine.cuda_graphs=true",
               "engine.async_scheduling=true")
    overlapped = []
    can_overlap = type(llm)._can_overlap
    monkeypatch.setattr(llm, "_can_overlap", lambda step: overlapped.append(can_overlap(llm, step)) or overlapped[-1])
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert sum(overlapped) > 3, "no verify step stayed in flight"


def test_engram_under_a_parallel_plan_is_refused(monkeypatch):
    """Refused once the model is built (its config names the Engram layers), before any collective."""
    monkeypatch.setattr("deepinfer.engine.llm.join", lambda plan, device: SimpleNamespace(expert=None))
    with pytest.raises(ConfigError, match=r"parallel=dp2 with Engram layers \[0, 3\] is not supported yet"):
        _llm("parallel=dp2")
