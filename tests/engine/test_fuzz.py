"""Fuzzing (hypothesis): SamplingParams either build a valid object or raise ValueError, and any
sequence of add / step / abort keeps the block manager's books: no block or state slot owned
twice, owned plus free equals the total, and every request ends exactly once."""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.engine.sampling_params import MAX_LOGPROBS

ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.floats(allow_nan=True),
                st.text(max_size=4), st.lists(st.one_of(st.integers(-3, 600), st.text(max_size=3)), max_size=3))
FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs", "stop", "stop_token_ids", "structured",
          "min_tokens", "banned_token_ids")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4))
def test_sampling_params_are_valid_or_refused_with_a_value_error(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return
    assert params.temperature >= 0 and not math.isnan(params.temperature)
    assert 0 < params.top_p <= 1 and isinstance(params.top_k, int) and params.top_k >= -1
    assert isinstance(params.max_tokens, int) and params.max_tokens >= 1
    assert params.seed is None or 0 <= params.seed < 2**64
    assert params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS
    assert all(isinstance(s, str) and s for s in params.stop)
    assert all(isinstance(t, int) and t >= 0 for t in params.stop_token_ids)
    assert all(isinstance(t, int) and t >= 0 for t in params.banned_token_ids)
    assert isinstance(params.min_tokens, int) and params.min_tokens >= 0


@pytest.fixture(scope="module")
def tight():
    """Few blocks and slots for the requests it takes, so that steps preempt."""
    return LLM("tiny_random", "reference", ["engine.use_tqdm=false", "model.max_model_len=256", "engine.num_kv_blocks=6",
                                            "engine.max_num_seqs=4"])


def _check_books(llm):
    kv, scheduler = llm.scheduler.kv, llm.scheduler
    holders = [*scheduler.running, *scheduler.waiting]
    launched = llm._inflight
    if launched is not None:
        holders += [r for r in launched.release_after if r not in holders]
    blocks = [b for r in holders for b in r.blocks]
    slots = [r.state_slot for r in holders if r.state_slot is not None]
    assert len(blocks) == len(set(blocks)) and not set(blocks) & set(kv.free_blocks), "a block owned twice"
    assert len(slots) == len(set(slots)) and not set(slots) & set(kv.free_slots), "a state slot owned twice"
    assert len(blocks) + len(kv.free_blocks) == kv.num_blocks - 1
    assert len(slots) + len(kv.free_slots) == kv.num_state_slots - 1
    assert all(not r.finished for r in holders if r in scheduler.running or r in scheduler.waiting)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 200), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_add_step_abort_keep_the_books(tight, ops):
    requests = []
    for op, a, b in ops:
        if op == "add":
            requests.append(tight.add_request([3 + (i * 7) % 500 for i in range(a)],
                                              SamplingParams(temperature=0, max_tokens=b, ignore_eos=True)))
        elif op == "step":
            for _ in range(a):
                tight.step()
        elif requests:
            tight.abort(requests[a % len(requests)].request_id)
        _check_books(tight)
    while tight.scheduler.has_work:
        tight.step()
        _check_books(tight)
    tight.drain()
    _check_books(tight)
    for request in requests:
        assert request.finished
        if request.finish_reason != "abort":
            assert request.finish_reason == "length" and len(request.output_token_ids) == request.params.max_tokens


SCHEMAS = st.one_of(
    st.none(), st.text(max_size=8),
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "object", "array", "nosuch", 3])}),
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(st.text("abc", min_size=1, max_size=3),
                                                         st.fixed_dictionaries({"type": st.sampled_from(
                                                             ["integer", "string", "boolean"])}), max_size=2)}),
)
SPECS = st.one_of(
    st.fixed_dictionaries({"type": st.just("json"), "schema": SCHEMAS}),
    st.fixed_dictionaries({"type": st.just("regex"), "schema": st.sampled_from(["[a-z]{1,4}", "(", "a|b", "[", "x*"])}),
    st.fixed_dictionaries({"type": st.just("ebnf"), "schema": st.sampled_from(['root ::= "a"', "root ::=", "nonsense",
                                                                               'root ::= [0-9]+'])}),
    st.dictionaries(st.sampled_from(["type", "schema", "extra"]), ANY, max_size=3),
)


@pytest.fixture(scope="module")
def structured_llm():
    pytest.importorskip("xgrammar")
    return LLM("tiny_random", "reference", ["engine.use_tqdm=false", "engine.max_num_seqs=4"])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(SPECS, min_size=1, max_size=3))
def test_structured_specs_run_or_fail_alone(structured_llm, specs):
    """Any spec either is refused by SamplingParams with a ValueError, or runs: a grammar that does
    not compile ends its request "error" with a message, and the plain request beside it is unharmed."""
    params = []
    for spec in specs:
        try:
            params.append(SamplingParams(temperature=0, max_tokens=4, structured=spec))
        except ValueError:
            continue
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = structured_llm.generate([[5, 6, 7]] * (len(params) + 1), params + [plain])
    for out in outputs[:-1]:
        assert out.finish_reason in ("stop", "length", "error")
        assert out.finish_reason != "error" or out.error
    assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 4
