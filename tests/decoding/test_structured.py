"""Structured outputs through the engine: every sampled output is valid for its grammar, DSpark
does not change greedy outputs, and a bad or slow grammar fails only its own request."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from deepinfer import LLM, SamplingParams  # noqa: E402
from tests.decoding.grammars import EBNF, JSON_SCHEMAS, REGEXES, valid_json  # noqa: E402

SEEDS = (0, 1, 2)
MAX_TOKENS = 160
ENGINE = ["engine.use_tqdm=false", "engine.max_num_seqs=72", "engine.max_num_batched_tokens=2048",
          "model.max_model_len=512"]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny_random", "reference", ENGINE)


def _params(kind: str, schema, seed: int, temperature: float = 1.0, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          structured={"type": kind, "schema": schema})


def _sample_all(llm, kind: str, grammars) -> list:
    params = [_params(kind, g, seed) for g in grammars for seed in SEEDS]
    return llm.generate(["{"] * len(params), params)


def _assert_all_valid(outputs, grammars, is_valid):
    """Every output that ends is valid for its grammar. A grammar that repeats without bound (a
    list of fields) gives a random-weights model no reason to close it, so an output may use all
    of its ``max_tokens`` instead (a cut output, not checked); at most one output in ten may."""
    for i, out in enumerate(outputs):
        grammar = grammars[i // len(SEEDS)]
        if out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS:
            continue
        assert out.finish_reason == "stop", (grammar, out.finish_reason, out.text, out.error)
        assert is_valid(out.text, grammar), (grammar, out.text)
    cut = sum(out.finish_reason == "length" for out in outputs)
    assert cut <= len(outputs) // 10, f"{cut} of {len(outputs)} outputs ran to max_tokens without closing their grammar"


def test_sampled_json_outputs_parse_and_validate_against_their_schemas(llm):
    assert len(JSON_SCHEMAS) >= 20
    schemas = [s if i % 2 else json.dumps(s) for i, s in enumerate(JSON_SCHEMAS)]  # dicts and strings
    _assert_all_valid(_sample_all(llm, "json", schemas), schemas, lambda text, schema: valid_json(text, schema))


def test_sampled_regex_outputs_match_their_patterns(llm):
    assert len(REGEXES) >= 20
    _assert_all_valid(_sample_all(llm, "regex", REGEXES), REGEXES,
                      lambda text, pattern: re.fullmatch(pattern, text) is not None)


def test_sampled_ebnf_outputs_parse_with_their_independent_checkers(llm):
    assert len(EBNF) >= 20
    grammars = [g for g, _ in EBNF]
    checks = dict(EBNF)
    _assert_all_valid(_sample_all(llm, "ebnf", grammars), grammars, lambda text, g: checks[g](text))


def test_any_json_option_yields_json():
    """Any JSON has unbounded strings, which a random-weights model never closes: use the trained
    tiny model, which mostly does. An output it leaves open uses all 200 tokens (a cut output,
    not checked); every output that ends is a JSON object or array, and most end."""
    trained = LLM("tiny", "reference", ["engine.use_tqdm=false"])
    outputs = trained.generate(["config = "] * 6, [SamplingParams(temperature=1.0, max_tokens=200, seed=s,
                                                                  structured={"type": "json"}) for s in range(6)])
    ended = [out for out in outputs if not (out.finish_reason == "length" and len(out.token_ids) == 200)]
    assert len(ended) >= 4, [(out.finish_reason, out.text[:60]) for out in outputs]
    for out in ended:
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        assert isinstance(json.loads(out.text), (dict, list))


def test_grammar_end_stops_generation_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=1.0, max_tokens=100, seed=5, ignore_eos=True,
                            structured={"type": "regex", "schema": "(yes|no)"})
    out = llm.generate("?", params)[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids


@pytest.mark.parametrize("varlen", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["all_drafts", "varlen"])
def test_greedy_structured_outputs_are_the_same_with_dspark(varlen):
    """Drafts come from the unconstrained drafter, so many violate the grammar and are rejected
    by verification; the accepted ones and the final tokens equal plain greedy decoding. The
    varlen variant (which verifies fewer drafts, the same grammar path) runs with --runslow."""
    cases = ([("json", s) for s in JSON_SCHEMAS[:8]] + [("regex", r) for r in REGEXES[:8]]
             + [("ebnf", g) for g, _ in EBNF[:8]])
    params = [_params(kind, g, seed=0, temperature=0.0, max_tokens=48) for kind, g in cases]
    prompts = [[3 + i, 40, 41] for i in range(len(cases))]
    plain = LLM("tiny_random", "reference", ENGINE).generate(prompts, params)
    drafted = LLM("tiny_random", "reference", ENGINE + ["decoding=dspark", f"decoding.varlen={str(varlen).lower()}"]
                  ).generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(o.num_drafted for o in drafted) > 0


@pytest.mark.parametrize("kind,schema,message", [
    ("json", '{"type": "strin"}', r'invalid json grammar: (Unsupported|Invalid) type:? "?strin'),
    ("json", "{not json", r"invalid json grammar: .*(parse|JSON)"),
    ("json", {"type": "integer", "minimum": 5, "maximum": 2}, r"invalid json grammar: .*minimum.* greater than maximum"),
    ("regex", "a(b", r"invalid regex grammar: .*parenthesis is not closed"),
    ("ebnf", "root ::= foo", r'invalid ebnf grammar: .*Rule "foo" is not defined'),
])
def test_an_invalid_grammar_fails_its_request_alone(llm, kind, schema, message):
    good = [_params("regex", r"\d{3}", seed=s) for s in range(2)]
    outputs = llm.generate(["a", "b", "c"], [good[0], _params(kind, schema, seed=0), good[1]])
    bad = outputs[1]
    assert bad.finish_reason == "error" and bad.token_ids == [] and re.search(message, bad.error), bad.error
    assert "[" not in bad.error.split(":")[0], "xgrammar's timestamp prefix must be stripped"
    for out in (outputs[0], outputs[2]):
        assert out.finish_reason == "stop" and re.fullmatch(r"\d{3}", out.text) and out.error is None


def _slow_schema(salt: int, properties: int = 3200) -> dict:
    """A strict schema of many optional patterned properties: xgrammar's compile time grows about
    quadratically with their count (seconds at 3,200 on a laptop core)."""
    return {"type": "object", "properties": {f"k{salt}_{i}": {"type": "string", "pattern": "^[a-z]{3,9}-[0-9]{2,5}$"}
                                             for i in range(properties)}}


def test_slow_grammars_fail_alone_in_this_call_and_the_next():
    """Two grammars slower than the timeout beside four trivial ones: with two workers, both
    start on the slow ones; the trivial ones wait (queued time does not count) and then compile
    on the replacement workers."""
    llm = LLM("tiny_random", "reference", ENGINE + ["engine.structured.compile_timeout_s=0.5",
                                                    "engine.structured.compile_workers=2"])
    integer = {"type": "integer", "minimum": 0, "maximum": 99}
    params = ([_params("json", _slow_schema(salt), seed=0) for salt in (0, 1)]
              + [_params("regex", r"\d{3}", seed=s) for s in range(2)] + [_params("json", integer, seed=s) for s in range(2)])
    outputs = llm.generate(["a"] * 6, params)
    for out in outputs[:2]:
        assert out.finish_reason == "error" and out.token_ids == [], (out.text, out.error)
        assert "did not compile within engine.structured.compile_timeout_s=0.5 s of compiling" in out.error
    for out in outputs[2:4]:
        assert out.finish_reason == "stop" and re.fullmatch(r"\d{3}", out.text), (out.text, out.error)
    for out in outputs[4:]:
        assert out.finish_reason == "stop" and valid_json(out.text, integer), (out.text, out.error)
    later = llm.generate(["b"] * 2, [_params("regex", "[ab]{4}", seed=3), _params("json", integer, seed=4)])
    assert later[0].finish_reason == "stop" and re.fullmatch("[ab]{4}", later[0].text), later[0].error
    assert later[1].finish_reason == "stop" and valid_json(later[1].text, integer), later[1].error


def test_exit_does_not_wait_for_a_compile_in_progress():
    """A compile of about a minute is running when the script ends: the process is gone within
    a few seconds (its workers are killed), not after the compile."""
    script = """
import json, sys, time
from deepinfer import LLM, SamplingParams
from tests.decoding.test_structured import ENGINE, _slow_schema
llm = LLM("tiny_random", "reference", ENGINE + ["engine.structured.compile_timeout_s=600"])
llm.add_request("a", SamplingParams(max_tokens=4, structured={"type": "json", "schema": _slow_schema(0, 9600)}))
deadline = time.monotonic() + 60
while not llm.grammars._pool._processes and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(2.0)
print("exiting", flush=True)
"""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parents[2])
    assert process.stdout.readline().strip() == "exiting"
    exiting = time.monotonic()
    process.wait(timeout=60)
    assert time.monotonic() - exiting < 2.0, "exit waited for the compile"
    assert process.returncode == 0


@pytest.mark.parametrize("value,message", [
    ({"type": "yaml", "schema": "x"}, r"'type' one of \['json', 'regex', 'ebnf'\]"),
    ("json", r"must be a dict"),
    ({"type": "json", "schema": {}, "strict": True}, r"unknown keys \['strict'\]"),
    ({"type": "json", "schema": 3}, r"must be a dict, a JSON string, or None for any JSON; got int"),
    ({"type": "json", "schema": {"x": {1, 2}}}, r"not JSON-serialisable"),
    ({"type": "regex", "schema": ""}, r"structured regex needs 'schema' as a non-empty string"),
    ({"type": "ebnf"}, r"structured ebnf needs 'schema' as a non-empty string"),
])
def test_malformed_structured_params_are_refused_when_built(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured=value)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend_llm(request):
    pytest.importorskip(request.param)
    return request.param, LLM("tiny_random", "reference", ENGINE + [f"engine.structured.backend={request.param}"])


def test_properties_are_generated_in_the_schema_order_from_a_dict_and_from_its_string(backend_llm):
    backend, llm = backend_llm
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 6},
                                               "answer": {"type": "string", "maxLength": 3}},
              "required": ["reasoning", "answer"]}
    seeds = range(4)
    outputs = llm.generate(["{"] * 8, [_params("json", s, seed) for s in (schema, json.dumps(schema)) for seed in seeds])
    for out in outputs:
        assert out.finish_reason == "stop", (out.text, out.error)
        assert [key for key, _ in json.loads(out.text, object_pairs_hook=list)] == ["reasoning", "answer"]
        assert out.metrics["structured_backend"] == backend
    assert [o.text for o in outputs[:4]] == [o.text for o in outputs[4:]]


def test_each_backend_samples_valid_json_for_every_schema(backend_llm):
    _, llm = backend_llm
    _assert_all_valid(_sample_all(llm, "json", JSON_SCHEMAS), JSON_SCHEMAS, valid_json)


def test_stop_happens_only_with_output_the_schema_accepts(llm):
    """``uniqueItems`` is not in the grammar: outputs with a repeated item end "error" naming it,
    the others "stop"; with five unique items out of four values no output can be valid."""
    import jsonschema

    possible = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 5}, "minItems": 3,
                "maxItems": 3, "uniqueItems": True}
    impossible = {**possible, "items": {"type": "integer", "minimum": 0, "maximum": 3}, "minItems": 5, "maxItems": 5}
    params = [_params("json", schema, seed) for schema in (possible, impossible) for seed in range(12)]
    outputs = llm.generate(["["] * len(params), params)
    for out, p in zip(outputs, params):
        schema = p.structured["schema"]
        valid = jsonschema.Draft202012Validator(json.loads(schema)).is_valid(json.loads(out.text))
        assert out.finish_reason == ("stop" if valid else "error"), (out.text, out.finish_reason, out.error)
        if not valid:
            assert "breaks its JSON schema: keyword 'uniqueItems' at $ " in out.error, out.error
        assert out.metrics["structured_validation_only"] == ["uniqueItems at #/uniqueItems"]
    assert all(o.finish_reason == "error" for o in outputs[12:])


@pytest.mark.parametrize("kind,schema,stop", [
    ("json", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}, ","),
    ("regex", r"x,y\d", ","),
])
def test_a_stop_string_inside_the_grammar_ends_error_not_stop(llm, kind, schema, stop):
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, stop=[stop],
                            structured={"type": kind, "schema": schema})
    out = llm.generate("{", params)[0]
    assert out.finish_reason == "error" and "before its grammar completed" in out.error, (out.text, out.error)


def test_a_schema_its_own_metaschema_rejects_fails_its_request_alone(llm):
    bad = {"type": "array", "items": {"type": "integer"}, "uniqueItems": "yes"}
    outputs = llm.generate(["a", "b"], [_params("json", bad, seed=0), _params("regex", r"\d{2}", seed=1)])
    assert outputs[0].finish_reason == "error" and outputs[0].token_ids == []
    assert "invalid json grammar: the JSON schema is not valid under Draft202012Validator" in outputs[0].error
    assert "at #/uniqueItems" in outputs[0].error
    assert outputs[1].finish_reason == "stop" and re.fullmatch(r"\d{2}", outputs[1].text)


@pytest.mark.parametrize("decoding", [[], ["decoding=dspark", "decoding.varlen=false"]], ids=["plain", "dspark"])
def test_a_rejected_output_is_generated_again_with_another_seed_when_retries_allow(decoding):
    """``uniqueItems``, which the grammar cannot enforce, with few values: many first attempts
    repeat an item. With retries every output that ends "stop" is valid, some needed a retry,
    and a request out of retries ends "error" with its count."""
    import jsonschema

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4}, "minItems": 3,
              "maxItems": 3, "uniqueItems": True}
    llm = LLM("tiny_random", "reference", ENGINE + ["engine.structured.retries=6"] + decoding)
    outputs = llm.generate(["["] * 12, [_params("json", schema, seed) for seed in range(12)])
    for out in outputs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
        else:
            assert out.finish_reason == "error" and out.metrics["structured_retries"] == 6, (out.text, out.error)
    assert any(o.finish_reason == "stop" and o.metrics["structured_retries"] > 0 for o in outputs)
    assert len(llm.scheduler.kv.free_blocks) == llm.scheduler.kv.num_blocks - 1, "a retried request leaked its cache"
    once = LLM("tiny_random", "reference", ENGINE + decoding).generate(["["] * 12,
                                                                     [_params("json", schema, s) for s in range(12)])
    assert [o.token_ids for o, r in zip(once, outputs) if r.metrics["structured_retries"] == 0] == \
        [o.token_ids for o in outputs if o.metrics["structured_retries"] == 0], "a first attempt is the same without retries"


def test_each_backend_samples_valid_regex_and_ebnf_outputs(backend_llm):
    """Under llguidance, EBNF is translated from GBNF to Lark, and ``\\d``, ``\\w``, ``\\s`` keep
    their ASCII meaning (llguidance's own regexes read them as Unicode classes)."""
    _, llm = backend_llm
    _assert_all_valid(_sample_all(llm, "regex", REGEXES), REGEXES,
                      lambda text, pattern: re.fullmatch(pattern, text, re.ASCII) is not None)
    grammars, checks = [g for g, _ in EBNF], dict(EBNF)
    _assert_all_valid(_sample_all(llm, "ebnf", grammars), grammars, lambda text, g: checks[g](text))
