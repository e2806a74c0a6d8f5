"""The structured-output pipeline without a model, on hand-written schemas of the keywords a
grammar cannot enforce: no invalid instance ends "stop" (the fast subset of
``experiments/structured_conformance.py``, which runs the official suite)."""
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

from deepinfer.decoding.conformance import canonical_text, pipeline_outcome  # noqa: E402
from deepinfer.decoding.structured import GrammarService  # noqa: E402
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
]


@pytest.fixture(scope="module")
def service():
    running = GrammarService(ByteTokenizer(), 300, timeout_s=60, workers=2)
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
