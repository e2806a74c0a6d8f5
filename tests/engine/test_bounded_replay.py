"""SWA bounded replay in the engine: config checks, mask == compact with continuous batching and
chunked prefill, prompts within keep_tokens untouched, exact replay after preemption and after
DSpark rollbacks."""
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config.compose import compose
from deepinfer.config.schema import ConfigError
from tests.decoding.forced_drafts import force_rejections

def _llm(mode: str, *overrides: str, chunk: int = 16) -> LLM:
    """Prefill chunks of ``chunk`` tokens, three chunks per step, keep_tokens 14 (window 8 + 6)."""
    return LLM("tiny_random", "reference", [
        "engine.use_tqdm=false", f"engine.max_num_batched_tokens={3 * chunk}", f"engine.prefill_chunk_tokens={chunk}",
        "engine.bounded_replay.keep_tokens=14", "model.max_model_len=256", f"engine.bounded_replay.mode={mode}",
        *overrides])


def _prompts(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_mask_and_compact_generate_the_same_tokens_and_short_prompts_match_off():
    prompts = _prompts((3, 14, 47, 100))
    tokens = {mode: [o.token_ids for o in _llm(mode).generate(prompts, GREEDY)] for mode in ("off", "mask", "compact")}
    assert tokens["compact"] == tokens["mask"]
    assert tokens["compact"][:2] == tokens["off"][:2], "prompts within keep_tokens must not change"


def test_a_request_recomputed_after_preemption_replays_exactly():
    """Two blocks for two requests that each grow past one block: one is preempted and recomputed
    (prompt and outputs); the kept suffix still starts at its original prompt's end - keep."""
    prompts = _prompts((124, 125), seed=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tight = _llm("compact", "engine.num_kv_blocks=3", "engine.max_num_seqs=2", chunk=64)
    outputs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0, "the cache budget did not force a preemption"
    roomy = _llm("compact", chunk=64).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]


def test_dspark_rollbacks_at_every_depth_keep_compact_replay_exact(monkeypatch):
    """keep_tokens 14 = window 8 + backtracking 6 leaves room for 5 drafts: with a rejection
    forced at every draft depth in turn, greedy output equals compact replay without drafts."""
    prompts, k = _prompts((14, 47, 100), seed=2), 5
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in _llm("compact").generate(prompts, params)]
    steps = force_rejections(monkeypatch, prompts, plain, k)
    for mode in ("compact", "mask"):
        outputs = _llm(mode, "decoding=dspark", f"decoding.num_draft_tokens={k}").generate(prompts, params)
        assert [o.token_ids for o in outputs] == plain, mode
        assert 0 < sum(o.num_accepted for o in outputs) < sum(o.num_drafted for o in outputs)
    assert steps["n"] > k, "every rollback depth must have been exercised"


def test_keep_tokens_below_window_plus_backtracking_is_refused():
    with pytest.raises(ValueError, match=r"keep_tokens=13 is too small.*8 \+ 6 = 14; raise it or set "
                                         r"engine.bounded_replay.mode=off"):
        _llm("compact", "engine.bounded_replay.keep_tokens=13")
    assert _llm("off", "engine.bounded_replay.keep_tokens=13").runner.bounded_replay.keep_tokens == 13


@pytest.mark.parametrize("override,match", [
    ("engine.bounded_replay.mode=truncate", r"engine\.bounded_replay\.mode='truncate' is invalid: use one of "
                                            r"\['off', 'mask', 'compact'\]"),
    ("engine.bounded_replay.keep_tokens=0", r"engine\.bounded_replay\.keep_tokens=0 is invalid: must be >= 1"),
])
def test_bad_bounded_replay_values_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        compose([override])
    assert compose().engine.bounded_replay.mode == "off"
