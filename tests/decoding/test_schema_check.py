"""The finished-output check of JSON structured outputs, by hand-worked instances: the keyword,
the instance path and the schema's own draft."""
import json

import pytest

pytest.importorskip("jsonschema")

from deepinfer.decoding.schema_check import json_validator, json_violation, validation_only_keywords  # noqa: E402

DRAFT7 = "http://json-schema.org/draft-07/schema#"


def _check(schema, text):
    return json_violation(text, json_validator(json.dumps(schema)))


def test_keywords_a_grammar_cannot_enforce_are_named_with_their_paths():
    assert "keyword 'uniqueItems' at $ " in _check({"type": "array", "uniqueItems": True}, "[1, 1]")
    found = _check({"properties": {"a": {"items": {"maximum": 3}}}}, '{"a": [1, 5]}')
    assert "keyword 'maximum' at $.a[1] (schema #/properties/a/items/maximum)" in found
    assert "keyword 'not'" in _check({"not": {"const": 0}}, "0")
    assert _check({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, "1").startswith(
        "the output breaks its JSON schema: keyword 'oneOf'")


def test_valid_output_and_any_json_pass_and_broken_json_is_named():
    assert _check({"type": "array", "uniqueItems": True}, "[1, 2]") is None
    assert json_violation('{"x": [true, null]}', None) is None
    assert json_violation('{"x": ', None).startswith("the output is not JSON: Expecting value")


def test_the_schema_is_read_under_its_own_draft():
    """Draft 7's array form of ``items`` checks each position; under 2020-12 (no ``$schema``)
    that form is not a valid schema at all."""
    tuple_items = {"items": [{"type": "integer"}, {"type": "string"}]}
    assert "keyword 'type' at $[1]" in _check({"$schema": DRAFT7, **tuple_items}, "[1, 2]")
    assert _check({"$schema": DRAFT7, **tuple_items}, '[1, "b"]') is None
    with pytest.raises(ValueError, match=r"not valid under Draft202012Validator: .* at #/items\)"):
        json_validator(json.dumps(tuple_items))
    with pytest.raises(ValueError, match="the JSON schema is not JSON"):
        json_validator("{not json")


def test_keywords_only_validation_enforces_are_listed_with_their_paths():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True, "items": {"minLength": 2}},
        "x": {"type": "integer", "oneOf": [{"minimum": 0}, {"not": {"const": 3}}]},
        "y": {"$ref": "#/$defs/y"}},
        "$defs": {"y": {"$ref": "urn:example:y"}}}
    assert validation_only_keywords(json.dumps(schema)) == [
        "uniqueItems at #/properties/tags/uniqueItems", "oneOf exclusivity at #/properties/x/oneOf",
        "type at #/properties/x/type", "not at #/properties/x/oneOf/1/not", "$ref at #/$defs/y/$ref"]
    assert validation_only_keywords(json.dumps({"type": "array", "items": {"type": "string", "minLength": 2}})) == []
    assert validation_only_keywords(None) == []


def test_an_output_that_cannot_be_validated_is_not_passed():
    found = _check({"$ref": "http://localhost:1234/integer.json"}, "1")
    assert found.startswith("the output could not be validated against its JSON schema: ")
    assert "localhost:1234/integer.json" in found
