"""The structured-output pipeline without a model, on hand-written schemas of the keywords a
grammar cannot enforce: no invalid instance ends "stop" (the fast subset of
``experiments/structured_conformance.py``, which runs the official suite)."""
import json

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

from deepinfer.decoding.conformance import canonical_text, pipeline_outcome  # noqa: E402
from deepinfer.decoding.grammar_service import GrammarService  # noqa: E402
from deepinfer.tokenizer import ByteTokenizer  # noqa: E402

OBJECT_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
CASES = [  # (schema, instance, valid)
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], True),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], False),
    ({"type": "integer", "not": {"const": 3}}, 4, True),
    ({"type": "integer", "not": {"const": 3}}, 3, False),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, -1.5, False),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, 2, False),
    ({**OBJECT_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}, False),
    ({**OBJECT_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, True),
    ({**OBJECT_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}, False),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "propertyNames": {"maxLength": 0}}, {"x": "s"},
     False),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}}, [1, 2], False),
    ({"type": "array", "items": {"minLength": 2}}, ["a"], False),
    ({"type": "string", "pattern": "^1(-a+)?$"}, "1a", False),
    ({"type": "string", "pattern": "^1(-a+)?$"}, "1-aa", True),
    ({"$defs": {"n": {"type": "integer", "minimum": 1}}, "$ref": "#/$defs/n"}, 0, False),
    ({"$ref": "http://localhost:1234/integer.json"}, 1, True),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}, {"anyOf": [{"maximum": 3}, {"multipleOf": 5}]}]}, 4, False),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}, {"anyOf": [{"maximum": 3}, {"multipleOf": 5}]}]}, 10, True),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"xa": "s"}, False),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"xa": 1}, True),
    ({**OBJECT_AB, "required": ["a"], "anyOf": [{"required": ["b"]}, {"properties": {"a": {"minimum": 5}}}]},
     {"a": 1}, False),
    ({**OBJECT_AB, "required": ["a"], "anyOf": [{"required": ["b"]}, {"properties": {"a": {"minimum": 5}}}]},
     {"a": 6}, True),
    ({"$defs": {"n": {"$id": "urn:example:n", "type": "integer"}}, "$ref": "urn:example:n"}, "s", False),
    ({"$defs": {"n": {"$anchor": "num", "type": "integer", "maximum": 3}}, "$ref": "#num"}, 2, True),
]


@pytest.fixture(scope="module", params=["xgrammar", "llguidance", "auto"])
def service(request):
    running = GrammarService(ByteTokenizer(), 300, timeout_s=60, workers=2, backend=request.param)
    yield running
    running.shutdown()


@pytest.mark.parametrize("schema,instance,valid", CASES)
def test_only_valid_instances_can_end_stop(service, schema, instance, valid):
    outcome, reason = pipeline_outcome(service, ByteTokenizer(), schema, canonical_text(instance))
    if not valid:
        assert outcome != "stop", "an invalid instance would end stop"
    assert (outcome == "stop") == (reason is None)


def test_the_grammar_or_validation_decides_as_expected(service):
    tokenizer = ByteTokenizer()
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert pipeline_outcome(service, tokenizer, unique, "[1, 2]") == ("stop", None)
    outcome, reason = pipeline_outcome(service, tokenizer, unique, "[1, 1]")
    assert outcome == "validation" and "keyword 'uniqueItems' at $ " in reason
    outcome, reason = pipeline_outcome(service, tokenizer, {"type": "integer"}, '"x"')
    assert outcome == "grammar" and "refuses token 0" in reason
    outcome, reason = pipeline_outcome(service, tokenizer, {"type": "strin"}, "1")
    assert outcome == "compile" and "invalid json grammar" in reason
    pattern = {"type": "string", "pattern": "^1(-a+)?$"}
    assert pipeline_outcome(service, tokenizer, pattern, '"1a"')[0] == "grammar", "xgrammar's optional-group bug"
    assert pipeline_outcome(service, tokenizer, pattern, '"1-aa"') == ("stop", None)


def test_auto_ends_stop_on_every_valid_instance_it_can_validate():
    """``auto`` picks llguidance for the allOf, patternProperties, keywords-beside-anyOf and
    ``$id`` / anchor cases, which xgrammar's strict grammar refuses or leaves to validation."""
    running = GrammarService(ByteTokenizer(), 300, timeout_s=60, workers=2, backend="auto")
    try:
        for schema, instance, valid in CASES:
            if valid and "http://" not in str(schema):
                outcome = pipeline_outcome(running, ByteTokenizer(), schema, canonical_text(instance))
                assert outcome == ("stop", None), schema
    finally:
        running.shutdown()


LESS_REFUSED = [  # (schema, valid instance): forms a grammar compiler alone refuses or mishandles
    ({"type": "string", "pattern": "^a[\r\n]b$"}, "a\nb"),
    ({"type": "string", "pattern": "(?i)^abc$"}, "AbC"),
    ({"type": "array", "items": [{"type": "integer"}, {"type": "string"}]}, [1, "x"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": False}}, {"a": 1}),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "minProperties": 1,
      "additionalProperties": False}, {"b": 2}),
]


@pytest.mark.parametrize("schema,instance", LESS_REFUSED)
def test_auto_compiles_what_one_library_alone_refuses(schema, instance):
    """Newline classes, inline flags, draft-7 tuples without ``$schema`` (read as draft 7, which
    the 2020-12 metaschema refuses and draft 7's allows), false subschemas, ``minProperties``
    beside closed objects."""
    running = GrammarService(ByteTokenizer(), 300, timeout_s=60, workers=1, backend="auto")
    try:
        assert pipeline_outcome(running, ByteTokenizer(), schema, canonical_text(instance)) == ("stop", None)
    finally:
        running.shutdown()


def test_a_schema_naming_no_draft_is_read_as_draft_7_only_when_2020_12_refuses_it():
    from deepinfer.decoding.schema_check import DRAFT7, with_inferred_draft

    tuple_items = {"items": [{"type": "integer"}]}
    assert json.loads(with_inferred_draft(json.dumps(tuple_items))) == {"$schema": DRAFT7, **tuple_items}
    for kept in ({"items": {"type": "integer"}}, {"$schema": DRAFT7, "items": {}}, {"type": 3}):
        assert with_inferred_draft(json.dumps(kept)) == json.dumps(kept)
