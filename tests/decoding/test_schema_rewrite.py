"""The grammar's rewritten schemas accept exactly what the schemas as written accept (checked
with jsonschema on instances of every JSON type), and take forms the grammar enforces."""
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

from deepinfer.decoding.schema_rewrite import grammar_schema  # noqa: E402

DRAFT7 = "http://json-schema.org/draft-07/schema#"
INSTANCES = [None, True, 0, 7, -2.5, "", "a", "abc", [], [1], [1, "x"], [1, "x", True], {}, {"a": 1},
             {"a": 1, "b": "s"}, {"b": "s"}, {"foo": 1}, {"bar": 2}]
SCHEMAS = [
    {"minLength": 2},
    {"minimum": 1, "maxLength": 2},
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False},
    {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}},
    {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"properties": {"b": {"minLength": 1}}}]},
    {"type": "object", "properties": {"foo": False, "bar": True}},
    {"type": "array", "items": False},
    {"anyOf": [False, {"type": "integer"}]},
    {"minItems": 1.0, "maxLength": 2.0},
    {"type": "array", "prefixItems": [{"type": "integer"}, False]},
    {"propertyNames": {"maxLength": 1}, "additionalProperties": {"type": "number"}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2},
]


def strict(node):
    """``node`` read as the grammar's strict mode reads it: no properties beyond those named, no
    items beyond a tuple's."""
    if isinstance(node, list):
        return [strict(child) for child in node]
    if not isinstance(node, dict):
        return node
    node = {key: strict(value) for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    if isinstance(node.get("items"), list) and "additionalItems" not in node:
        node["additionalItems"] = False
    if "prefixItems" in node and "items" not in node:
        node["items"] = False
    return node


STRICT_ONLY = (3, 4, 6, 10)
"""Rewrites equivalent in strict mode only (a dropped ``false`` property, a tuple's extra items)."""


@pytest.mark.parametrize("index", range(len(SCHEMAS)), ids=[json.dumps(s)[:40] for s in SCHEMAS])
def test_rewritten_schema_accepts_what_the_schema_accepts(index):
    """The rewritten schema read in the grammar's (2020-12) vocabulary; both in strict mode
    where the rewrite relies on it."""
    schema = SCHEMAS[index]
    read = strict if index in STRICT_ONLY else (lambda node: node)
    rewritten = {k: v for k, v in json.loads(grammar_schema(json.dumps(schema))).items() if k != "$schema"}
    original = jsonschema.validators.validator_for(schema)(read(schema))
    again = jsonschema.Draft202012Validator(read(rewritten))
    for instance in INSTANCES:
        assert again.is_valid(instance) == original.is_valid(instance), (rewritten, instance)


def test_forms_the_grammar_enforces():
    assert json.loads(grammar_schema('{"minLength": 2}'))["anyOf"][0] == {"type": "string", "minLength": 2}
    draft7 = json.loads(grammar_schema(json.dumps(SCHEMAS[4])))
    assert draft7["prefixItems"] == [{"type": "integer"}] and draft7["items"] == {"type": "string"}
    merged = json.loads(grammar_schema(json.dumps(SCHEMAS[5])))
    assert "allOf" not in merged and merged["required"] == ["a"] and list(merged["properties"]) == ["a", "b"]
    assert json.loads(grammar_schema(json.dumps(SCHEMAS[6])))["properties"] == {"bar": {}}
    assert json.loads(grammar_schema(json.dumps(SCHEMAS[7]))) == {"type": "array", "maxItems": 0}
    assert json.loads(grammar_schema(json.dumps(SCHEMAS[9])))["anyOf"][:2] == [
        {"type": "string", "maxLength": 2}, {"type": "array", "minItems": 1, "items": {}}]
    assert json.loads(grammar_schema(json.dumps(SCHEMAS[10]))) == {"type": "array", "prefixItems": [{"type": "integer"}],
                                                                   "maxItems": 1}
    assert json.loads(grammar_schema(json.dumps(SCHEMAS[11])))["propertyNames"] == {"type": "string", "maxLength": 1}
    assert json.loads(grammar_schema(json.dumps(SCHEMAS[12])))["additionalProperties"] is True
    text = '{"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}'
    assert grammar_schema(text) == text and grammar_schema(None) is None
    pointing = json.dumps({"$schema": DRAFT7, "items": [{"type": "integer"}, {"$ref": "#/items/0"}]})
    assert grammar_schema(pointing) == pointing, "a rewrite that breaks a local $ref is not taken"


@pytest.mark.parametrize("pattern,counted", [
    (r"^1(-a+)?$", r"^1(-a+){0,1}$"), (r"^x(ab)??y$", r"^x(ab){0,1}?y$"), (r"\)?a", r"\)?a"),
    (r"[)]?(a)?", r"[)]?(a){0,1}"), (r"[]a)]?(b)?", r"[]a)]?(b){0,1}"), (r"((a)?b)?", r"((a){0,1}b){0,1}"),
])
def test_optional_groups_are_counted_in_the_same_language(pattern, counted):
    import re

    from deepinfer.decoding.schema_rewrite import optional_groups_counted

    assert optional_groups_counted(pattern) == counted
    for text in ["", "1", "1a", "1-a", "1-aa", "xy", "xaby", ")", ")a", "a", "b", "ab", "]", "]b", "aab"]:
        assert bool(re.fullmatch(pattern, text)) == bool(re.fullmatch(counted, text)), text
