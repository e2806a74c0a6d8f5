"""``$ref`` resolution for the grammar: the resolved schema accepts exactly what the schema as
written accepts (checked with jsonschema on instances of every JSON type), and holds only local
pointers, into a ``$defs`` section at its root, for recursive references."""
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

from deepinfer.decoding import schema_refs  # noqa: E402
from deepinfer.decoding.schema_refs import draft_of, local_refs, resolve_refs  # noqa: E402

DRAFT7 = "http://json-schema.org/draft-07/schema#"
INSTANCES = [None, True, 0, 3, -1.5, "", "ab", [], [1], [1, "x"], [[1], 2], {}, {"a": 1}, {"a": "x"}, {"a": {"a": 2}},
             {"a": {"a": "x"}}, {"a": [1, 2, 3]}, {"b": 1}, {"a": 1, "b": "x"}]
SCHEMAS = [
    {"$defs": {"n": {"type": "integer", "minimum": 1}}, "properties": {"a": {"$ref": "#/$defs/n"}}},
    {"$schema": DRAFT7, "definitions": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/definitions/s"}}},
    {"$id": "http://example.com/root.json", "$defs": {"x": {"$id": "item.json", "type": "integer"}},
     "properties": {"a": {"$ref": "item.json"}}},
    {"$id": "http://example.com/dir/root.json", "$defs": {"x": {"$id": "sub/x.json", "$defs": {
        "y": {"$id": "y.json", "minimum": 2}}, "$ref": "y.json"}}, "properties": {"a": {"$ref": "sub/x.json"}}},
    {"$defs": {"x": {"$anchor": "num", "type": "number"}}, "items": {"$ref": "#num"}},
    {"$id": "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed", "$defs": {"s": {"type": "string"}},
     "properties": {"a": {"$ref": "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed#/$defs/s"}}},
    {"properties": {"a": {"$ref": "#"}}, "additionalProperties": False},
    {"$defs": {"tree": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/tree"}]}}},
     "properties": {"a": {"$ref": "#/$defs/tree"}, "b": {"$ref": "#/$defs/tree"}}},
    {"$schema": DRAFT7, "definitions": {"arr": {"type": "array"}}, "properties": {"a": {"$ref": "#/definitions/arr",
                                                                                       "maxItems": 2}}},
    {"$defs": {"arr": {"type": "array"}}, "properties": {"a": {"$ref": "#/$defs/arr", "maxItems": 2}}},
    {"$schema": DRAFT7, "items": [{"type": "integer"}, {"$ref": "#/items/0"}]},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:50] for s in SCHEMAS])
def test_resolved_schema_accepts_what_the_schema_accepts(schema):
    resolved, _ = resolve_refs(schema, draft_of(schema))
    original = jsonschema.validators.validator_for(schema)(schema)
    again = jsonschema.validators.validator_for(schema)({**resolved, "$schema": schema.get("$schema", "")}
                                                        if "$schema" in schema else resolved)
    for instance in INSTANCES:
        assert again.is_valid(instance) == original.is_valid(instance), (resolved, instance)
    assert all(ref == "#" or ref.startswith("#/$defs/ref") for ref in local_refs(resolved)), resolved


def test_references_are_inlined_or_pointed_at_recursive_definitions():
    inlined, _ = resolve_refs(SCHEMAS[2], 2020)
    assert inlined == {"properties": {"a": {"type": "integer"}}}
    assert resolve_refs(SCHEMAS[6], 2020)[0] == SCHEMAS[6]
    tree, _ = resolve_refs(SCHEMAS[7], 2020)
    assert tree["properties"] == {"a": {"$ref": "#/$defs/ref0"}, "b": {"$ref": "#/$defs/ref0"}}
    assert tree["$defs"]["ref0"]["items"]["anyOf"][1] == {"$ref": "#/$defs/ref0"}
    draft7, _ = resolve_refs(SCHEMAS[8], 7)
    assert draft7["properties"]["a"] == {"type": "array"}, "draft 7 ignores keywords beside $ref"
    assert resolve_refs(SCHEMAS[9], 2020)[0]["properties"]["a"] == {"maxItems": 2, "allOf": [{"type": "array"}]}


def test_an_unresolvable_reference_stays_as_written():
    remote = {"properties": {"a": {"$ref": "http://localhost:1234/integer.json"}, "b": {"$ref": "#/$defs/none"}}}
    assert resolve_refs(remote, 2020)[0] == remote


def test_non_pointer_references_resolved_are_recorded_where_they_stand():
    resolved, provenance = resolve_refs(SCHEMAS[3], 2020)
    assert provenance.enforced(resolved) == {"$ref at #/properties/a/$ref", "$ref at #/$defs/x/$ref"}
    pointing, provenance = resolve_refs(SCHEMAS[0], 2020)
    assert provenance.enforced(pointing) == set(), "validation only reads a local pointer the grammar follows"


def test_past_the_inlining_budget_every_reference_is_a_pointer(monkeypatch):
    monkeypatch.setattr(schema_refs, "INLINED_NODES", 3)
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(4)}
    schema = {"$defs": {**defs, "d4": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/d0"}}}
    resolved, _ = resolve_refs(schema, 2020)
    assert resolved["properties"]["a"] == {"$ref": "#/$defs/ref0"} and len(resolved["$defs"]) == 5
    for instance in [{"a": [[[[1]]]]}, {"a": [[[["x"]]]]}, {"a": [1]}]:
        assert jsonschema.Draft202012Validator(resolved).is_valid(instance) == \
            jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_the_draft_is_the_one_validation_reads():
    assert draft_of({"$schema": DRAFT7}) == 7 and draft_of({}) == 2020 and draft_of(True) == 2020
    assert draft_of({"$schema": "http://json-schema.org/draft-04/schema#"}) == 4
    assert draft_of({"$schema": "http://localhost:1234/custom-metaschema.json"}) == 2020
