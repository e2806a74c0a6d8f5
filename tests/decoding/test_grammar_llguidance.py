"""llguidance behind xgrammar's matcher interface: the same masks and the same accept, stop and
rollback behaviour as xgrammar's matcher on the same strict schema; strict mode written out; the
backend ``auto`` picks and what each request reports."""
import json
import random
import re

import pytest
import torch

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from deepinfer.decoding.grammar_llguidance import ascii_classes, llguidance_schema  # noqa: E402
from deepinfer.decoding.grammar_service import GrammarService  # noqa: E402
from deepinfer.decoding.structured import check_structured  # noqa: E402
from deepinfer.tokenizer import ByteTokenizer  # noqa: E402
from tests.decoding.test_structured import _slow_schema  # noqa: E402

VOCAB = 300
EOS = 1
PLAIN = [EOS] + [3 + b for b in range(0x20, 0x7F) if b != 0x5C]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"]}


@pytest.fixture(scope="module")
def services():
    running = {b: GrammarService(ByteTokenizer(), VOCAB, timeout_s=60, workers=1, backend=b)
               for b in ("xgrammar", "llguidance", "auto")}
    yield running
    for service in running.values():
        service.shutdown()


def _ready(service, kind: str, schema):
    grammar = service.request(check_structured({"type": kind, "schema": schema}))
    service.wait(grammar, 120)
    assert grammar.error is None, grammar.error
    return grammar


def _mask(matcher) -> torch.Tensor:
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask


def _plain(bitmask: torch.Tensor) -> set[int]:
    """The allowed ids among the stop token and printable ASCII other than the backslash (where
    the two libraries differ by design: xgrammar allows no escapes in a length-bounded string,
    llguidance no raw DEL)."""
    return {t for t in PLAIN if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


def _tokens(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


@pytest.mark.parametrize("kind,schema,text", [
    ("json", SCHEMA, '{"name": "ab", "tags": ["bc", "a"], "n": 12}'),
    ("json", SCHEMA, '{"name": "", "n": 0}'),
    ("regex", r"(ab|c)+[0-9]{2}", "abcab42"),
])
def test_llguidance_masks_and_steps_match_xgrammar(services, kind, schema, text):
    """Along an accepted text, with other tokens tried and random rollbacks, both matchers allow
    the same plain tokens at every step and agree on every accept and on termination."""
    xg = _ready(services["xgrammar"], kind, schema).matcher
    lg = _ready(services["llguidance"], kind, schema).matcher
    rng, tokens, done = random.Random(0), _tokens(text) + [EOS], 0
    while done < len(tokens):
        assert _plain(_mask(xg)) == _plain(_mask(lg)), f"masks differ after {bytes(t - 3 for t in tokens[:done])!r}"
        other = rng.choice(PLAIN[1:])
        if other != tokens[done]:
            took = xg.accept_token(other)
            assert lg.accept_token(other) == took
            if took:
                xg.rollback(1)
                lg.rollback(1)
        assert xg.accept_token(tokens[done]) and lg.accept_token(tokens[done])
        done += 1
        assert xg.is_terminated() == lg.is_terminated() == (done == len(tokens))
        if 2 < done < len(tokens) and rng.random() < 0.2:
            back = rng.randint(1, min(done, 5))
            xg.rollback(back)
            lg.rollback(back)
            done -= back
    assert not lg.accept_token(tokens[0]), "a terminated matcher accepts nothing"
    lg.reset()
    fresh = _ready(services["llguidance"], kind, schema).matcher
    assert not lg.is_terminated() and _plain(_mask(lg)) == _plain(_mask(fresh))


def test_a_stop_token_is_refused_until_the_grammar_may_end(services):
    matcher = _ready(services["llguidance"], "json", {"type": "integer"}).matcher
    assert not matcher.accept_token(EOS)
    assert matcher.accept_token(_tokens("7")[0]) and matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.accept_token(_tokens("3")[0])


def test_llguidance_schema_closes_listed_objects_and_tuples_but_not_intersections():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "$defs": {"base": {"properties": {"x": {}}}, "free": {"properties": {"y": {}}}},
              "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"z": {}}}],
              "anyOf": [{"required": ["a"]}, {"required": ["z"]}]}
    schema["properties"]["t"] = {"anyOf": [{"prefixItems": [{}]}, {"prefixItems": [{}], "items": {"type": "integer"}}]}
    out = json.loads(llguidance_schema(json.dumps(schema)))
    assert "additionalProperties" not in out, "beside allOf/anyOf the root intersects its entries"
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["$defs"]["base"], "referenced inside an allOf"
    assert out["$defs"]["free"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][1]
    tuples = out["properties"]["t"]["anyOf"]
    assert tuples[0]["items"] is False and tuples[1]["items"] == {"type": "integer"}
    assert llguidance_schema(json.dumps({"properties": {"a": {}}, "patternProperties": {"^x": {}}})) == json.dumps(
        {"properties": {"a": {}}, "patternProperties": {"^x": {}}})


def test_llguidance_schema_accepts_what_the_schema_accepts_less_the_unlisted_properties():
    """Closing adds exactly "no unlisted property": jsonschema agrees on every instance that
    lists only named properties, and the closed schema refuses the others."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"prefixItems": [{"type": "string"}]}},
              "required": ["a"]}
    closed = json.loads(llguidance_schema(json.dumps(schema)))
    for instance in ({"a": 1}, {"a": 1, "b": ["x"]}, {"a": "1"}, {"a": 1, "b": [3]}, {}):
        assert jsonschema.Draft202012Validator(schema).is_valid(instance) == \
            jsonschema.Draft202012Validator(closed).is_valid(instance), instance
    for instance in ({"a": 1, "c": 2}, {"a": 1, "b": ["x", "y"]}):
        assert jsonschema.Draft202012Validator(schema).is_valid(instance)
        assert not jsonschema.Draft202012Validator(closed).is_valid(instance), instance


def test_auto_picks_the_backend_that_leaves_less_to_validation(services):
    auto = services["auto"]
    pattern_props = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}
    grammar = _ready(auto, "json", pattern_props)
    assert grammar.backend == "llguidance" and grammar.validation_only == []
    xgrammar_only = _ready(services["xgrammar"], "json", pattern_props).validation_only
    assert xgrammar_only == ["patternProperties at #/patternProperties"]
    regex = _ready(auto, "regex", r"\d+")
    assert regex.backend == "xgrammar", "regex and EBNF keep xgrammar's dialect"
    unique = _ready(auto, "json", {"type": "array", "uniqueItems": True, "items": {"not": {"const": 1}}})
    assert unique.validation_only == ["uniqueItems at #/uniqueItems", "not at #/items/not"]


def test_a_grammar_past_llguidances_limits_is_refused_at_compile_not_midway():
    """3,200 optional properties overflow llguidance's parser rows on the first property (or, on a
    loaded machine, its first masks take longer than the walk allows): the compile walk finds it,
    so the request fails at compile with llguidance's reason."""
    only = GrammarService(ByteTokenizer(), VOCAB, timeout_s=120, workers=1, backend="llguidance")
    try:
        grammar = only.request(check_structured({"type": "json", "schema": json.dumps(_slow_schema(0, 3200))}))
        only.wait(grammar, 120)
        assert grammar.error is not None and "llguidance" in grammar.error
        assert re.search(r"max is \d+|s to compute one token mask", grammar.error), grammar.error
    finally:
        only.shutdown()


def test_auto_falls_back_to_xgrammar_when_llguidance_refuses(services):
    remote = {"$ref": "http://localhost:1234/integer.json"}
    grammar = services["llguidance"].request(check_structured({"type": "json", "schema": remote}))
    services["llguidance"].wait(grammar, 120)
    assert grammar.error is not None and "integer.json" in grammar.error
    fallback = _ready(services["auto"], "json", remote)
    assert fallback.backend == "xgrammar" and fallback.validation_only == ["$ref at #/$ref"]


@pytest.mark.parametrize("pattern,expected", [
    (r"^\d{3}-\w+\s?$", r"^[0-9]{3}-[0-9A-Za-z_]+[ \t\n\r\f\v]?$"),
    (r"[\d.]+\D", r"[0-9.]+[^0-9]"),
    (r"[^\s]\\d\]\d", r"[^ \t\n\r\f\v]\\d\][0-9]"),
    (r"[]\d]", r"[]0-9]"),
])
def test_ascii_classes(pattern, expected):
    assert ascii_classes(pattern) == expected
    import re
    samples = ["123-ab", "1a2", "٣", "x y", "\\d]5", "]", "9", "a\n", "é"]
    for text in samples:
        assert bool(re.fullmatch(pattern, text, re.ASCII)) == bool(re.fullmatch(expected, text)), text


def test_format_is_asserted_beside_a_string_type_only_under_both_backends(services):
    """Untyped, ``format`` stays the annotation JSON Schema makes it by default (a string that is
    not a date ends "stop"); beside ``"type": "string"`` both backends hold strings to it."""
    from deepinfer.decoding.conformance import pipeline_outcome

    untyped, typed = {"format": "date"}, {"type": "string", "format": "date"}
    assert json.loads(llguidance_schema(json.dumps({"properties": {"d": untyped}}))) == {
        "properties": {"d": {}}, "additionalProperties": False}
    for service in services.values():
        assert pipeline_outcome(service, ByteTokenizer(), untyped, '"06/19/1963"') == ("stop", None)
        assert pipeline_outcome(service, ByteTokenizer(), typed, '"06/19/1963"')[0] == "grammar"
        assert pipeline_outcome(service, ByteTokenizer(), typed, '"1963-06-19"') == ("stop", None)
