"""The grammar's rewritten schemas accept exactly what the schemas as written accept (checked
with jsonschema on instances of every JSON type, under the grammar's strict reading where a
rewrite relies on it), take forms the grammar enforces, and name the keywords it then enforces."""
import itertools
import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")

from deepinfer.decoding.schema_check import validation_only_keywords  # noqa: E402
from deepinfer.decoding.schema_rewrite import (enforced_by_rewrite, grammar_schema,  # noqa: E402
                                               optional_groups_counted, searched)

DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"
OBJECTS = [dict(zip(names, values)) for size in range(4) for names in itertools.combinations(("a", "b", "kind"), size)
           for values in itertools.product((1, "x", "a", True, None), repeat=size)]
INSTANCES = [None, True, False, 0, 0.0, 7, 7.0, -2.5, -100, 4, "", "a", "abc", "xaay", "y", [], [0], [0.0], [1], [1, "x"],
             [1, "x", True], {"foo": 1}, {"bar": 2}, {"a": 1.0}, {"a": 7, "b": 2}, *OBJECTS]
KIND_AB = {"kind": {"enum": ["a", "b"]}, "a": {}, "b": {}}
SCHEMAS = [  # (schema, reading): "json" as written, "strict" as the grammar's strict mode reads it
    ({"minLength": 2}, "json"),
    ({"minimum": 1, "maxLength": 2}, "json"),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "json"),
    ({"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False},
     "strict"),
    ({"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}},
     "strict"),
    ({"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                  {"properties": {"b": {"minLength": 1}}}]}, "json"),
    ({"type": "object", "properties": {"foo": False, "bar": True}}, "strict"),
    ({"type": "array", "items": False}, "json"),
    ({"anyOf": [False, {"type": "integer"}]}, "json"),
    ({"minItems": 1.0, "maxLength": 2.0}, "json"),
    ({"required": ["a"], "uniqueItems": True, "minLength": 2}, "json"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, False]}, "strict"),
    ({"propertyNames": {"maxLength": 1}, "additionalProperties": {"type": "number"}}, "json"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2}, "json"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, "strict"),
    ({"properties": {"a": {}, "b": {}, "kind": {}}, "dependentRequired": {"a": ["b"], "kind": ["a"]}}, "strict"),
    ({"$schema": DRAFT7, "properties": {"a": {}, "b": {"type": "integer"}},
      "dependencies": {"a": ["b"], "b": {"properties": {"a": {"type": "integer"}}}}}, "strict"),
    ({"properties": {"a": {}, "b": {}}, "dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}},
                                                                   "required": ["b"]}}}, "strict"),
    ({"properties": {"a": {}, "b": {}}, "if": {"required": ["a"]}, "then": {"required": ["b"]},
      "else": {"properties": {"b": {"type": "string"}}}}, "strict"),
    ({"properties": KIND_AB, "required": ["kind"], "if": {"properties": {"kind": {"const": "a"}}},
      "then": {"required": ["a"]}, "else": {"required": ["b"]}}, "strict"),
    ({"properties": {"kind": {"type": "boolean"}, "a": {"type": "integer"}},
      "if": {"properties": {"kind": {"const": True}}, "required": ["kind"]}, "then": {"required": ["a"]},
      "else": {"properties": {"a": {"type": "string"}}}}, "strict"),
    ({"if": {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
      "then": {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
      "else": {"properties": {"b": {"type": "string"}}, "required": ["b"]}, "unevaluatedProperties": False}, "json"),
    ({"properties": {"kind": {"type": "string"}}, "anyOf": [{"properties": {"a": {"const": 1}}, "required": ["a"]},
                                                            {"properties": {"b": {"const": "x"}}, "required": ["b"]}],
      "unevaluatedProperties": False}, "json"),
    ({"properties": {"kind": {}}, "required": ["kind"], "oneOf": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {}}, "required": ["b"]}]},
     "json"),
    ({"unevaluatedProperties": False}, "json"),
    ({"properties": {"a": {"type": "integer"}}, "patternProperties": {"^b": {"type": "string"}},
      "unevaluatedProperties": {"type": "boolean"}}, "json"),
    ({"prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "string"}}, "json"),
    ({"$schema": DRAFT7, "properties": {"a": {}}, "unevaluatedProperties": False, "dependentRequired": {"a": ["b"]}},
     "json"),
    ({"const": 0}, "json"),
    ({"enum": [1, "x", [0], {"a": 7}]}, "json"),
    ({"type": "integer", "enum": [7, 2.5, "x"]}, "json"),
    ({"type": "string", "pattern": "a+"}, "json"),
    ({"pattern": "^x|y$"}, "json"),
    ({"type": "object", "required": ["a"]}, "json"),
    ({"$schema": DRAFT4, "type": "number", "minimum": 0, "exclusiveMinimum": True}, "json"),
    ({"allOf": [{"if": {"exclusiveMaximum": 0}}, {"then": {"minimum": -10}}, {"else": {"multipleOf": 2}}]}, "json"),
]
IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "contains", "propertyNames")
APPLIED = ("allOf", "anyOf", "oneOf", "if", "dependentSchemas", "dependentRequired", "dependencies")


def strict(node, closing, generated=True):
    """``node`` read as the grammar's strict mode reads it: an object allows only the properties it
    and the subschemas it applies in place name (``closing``: ``unevaluatedProperties: false``, or
    ``additionalProperties: false`` where that keyword does not exist), a tuple no items past its
    own; subschemas applied in place are read as written, the objects inside them strictly."""
    if isinstance(node, list):
        return [strict(child, closing, generated) for child in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in IN_PLACE:
            out[key] = strict(value, closing, False)
        elif key in ("properties", "$defs", "patternProperties", "dependentSchemas", "dependencies") \
                and isinstance(value, dict):
            out[key] = {name: strict(child, closing, key not in APPLIED) for name, child in value.items()}
        elif key in ("items", "prefixItems", "additionalProperties", "additionalItems", "unevaluatedItems"):
            out[key] = strict(value, closing)
        else:
            out[key] = value
    if generated and ("properties" in out or any(k in out for k in APPLIED)) \
            and not any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out.update(closing)
    if generated and isinstance(out.get("items"), list) and "additionalItems" not in out:
        out["additionalItems"] = False
    if generated and "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


def _read(schema, reading):
    """A validator of ``schema`` under its own draft, read as ``reading`` says."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if reading == "strict":
        closing = "unevaluatedProperties" if cls is jsonschema.Draft202012Validator else "additionalProperties"
        schema = strict(schema, {closing: False})
    return cls(schema)


@pytest.mark.parametrize("schema,reading", SCHEMAS, ids=[json.dumps(s)[:50] for s, _ in SCHEMAS])
def test_rewritten_schema_accepts_what_the_schema_accepts(schema, reading):
    """The rewritten schema read in the grammar's (2020-12) vocabulary."""
    rewritten = json.loads(grammar_schema(json.dumps(schema)))
    original, again = _read(schema, reading), _read(rewritten, reading)
    for instance in INSTANCES:
        assert again.is_valid(instance) == original.is_valid(instance), (rewritten, instance)


def _rewritten(index):
    return json.loads(grammar_schema(json.dumps(SCHEMAS[index][0])))


def test_forms_the_grammar_enforces():
    assert _rewritten(0)["anyOf"][0] == {"type": "string", "minLength": 2}
    draft7 = _rewritten(4)
    assert draft7["prefixItems"] == [{"type": "integer"}] and draft7["items"] == {"type": "string"}
    merged = _rewritten(5)
    assert "allOf" not in merged and merged["required"] == ["a"] and list(merged["properties"]) == ["a", "b"]
    assert _rewritten(6)["properties"] == {"bar": {}}
    assert _rewritten(7) == {"type": "array", "maxItems": 0}
    assert _rewritten(9)["anyOf"][:2] == [{"type": "string", "maxLength": 2},
                                          {"type": "array", "minItems": 1, "items": {}}]
    assert _rewritten(11) == {"type": "array", "prefixItems": [{"type": "integer"}], "maxItems": 1}
    assert _rewritten(12)["anyOf"][0] == {"type": "object", "additionalProperties": {"type": "number"},
                                          "propertyNames": {"type": "string", "maxLength": 1}}
    assert _rewritten(13)["additionalProperties"] is True
    assert _rewritten(2)["anyOf"][0] == {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = '{"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}'
    assert grammar_schema(text) == text and grammar_schema(None) is None


def test_conditional_keywords_become_branches():
    assert _rewritten(14) == {"anyOf": [
        {"type": "object", "properties": {"b": {}}},
        {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"]}]}
    discriminated = [branch["anyOf"][0] for branch in _rewritten(19)["anyOf"]]
    assert [branch["properties"]["kind"] for branch in discriminated] == [{"enum": ["a"]}, {"enum": ["b"]}]
    assert [branch["required"] for branch in discriminated] == [["kind", "a"], ["kind", "b"]]
    subsets = [branch["anyOf"][0] for branch in _rewritten(22)["anyOf"]]
    assert [list(s["properties"]) for s in subsets] == [["kind", "a"], ["kind", "b"], ["kind", "a", "b"]]
    assert all(s["additionalProperties"] is False for s in subsets)
    assert [list(b["anyOf"][0]["properties"]) for b in _rewritten(23)["oneOf"]] == [["kind", "a"], ["kind", "b"]]


@pytest.mark.parametrize("schema", [
    {"type": "object", "dependentRequired": {"a": ["b"]}},
    {"properties": {"kind": {"type": "string"}}, "if": {"properties": {"kind": {"const": "a"}}},
     "then": {"required": ["kind"]}},
    {"properties": {"a": {}}, "if": {"properties": {"a": {"minimum": 2}}}, "then": {"required": ["a"]}},
    {"properties": {n: {} for n in "abcd"}, "dependentRequired": {n: ["a"] for n in "abcd"}},
    {"properties": {"a": {}}, "dependentSchemas": {"a": {"anyOf": [{"required": ["b"]}]}}},
], ids=["open object", "infinite domain", "not a discriminator", "over 8 branches", "not plain"])
def test_conditional_keywords_stay_where_no_exact_expansion_exists(schema):
    rewritten = json.loads(grammar_schema(json.dumps(schema)))
    assert any(key in json.dumps(rewritten) for key in ('"if"', '"dependentRequired"', '"dependentSchemas"'))
    assert enforced_by_rewrite(json.dumps(schema)) == set()


def test_integral_numbers_are_ranges_and_patterns_match_anywhere():
    assert _rewritten(28) == {"type": "number", "minimum": 0, "maximum": 0}
    assert _rewritten(29)["anyOf"][1] == {"type": "array", "prefixItems": [{"type": "number", "minimum": 0,
                                                                            "maximum": 0}], "minItems": 1}
    assert _rewritten(30) == {"type": "number", "minimum": 7, "maximum": 7}
    assert _rewritten(31)["pattern"] == "^.*a+.*$"
    assert _rewritten(32)["anyOf"][0] == {"type": "string", "pattern": "^(?:x.*|.*y)$"}


def test_unevaluated_keywords_become_plain_ones_or_open_beside_applicators():
    assert _rewritten(24)["anyOf"][0] == {"type": "object", "additionalProperties": False}
    assert _rewritten(26)["anyOf"][0] == {"type": "array", "prefixItems": [{"type": "integer"}],
                                          "items": {"type": "string"}}
    beside = {"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}, {"properties": {"b": {"minimum": 1}}}],
              "unevaluatedProperties": False}
    assert json.loads(grammar_schema(json.dumps(beside)))["additionalProperties"] == {}


ENFORCED = [
    (SCHEMAS[14][0], {"dependentRequired at #/dependentRequired"}),
    (SCHEMAS[16][0], {"dependencies at #/dependencies"}),
    (SCHEMAS[19][0], {"if at #/if", "then at #/then", "else at #/else"}),
    (SCHEMAS[21][0], {"if at #/if", "then at #/then", "else at #/else",
                      "unevaluatedProperties at #/unevaluatedProperties"}),
    (SCHEMAS[22][0], {"properties at #/properties", "unevaluatedProperties at #/unevaluatedProperties"}),
    ({"properties": {"x": {"type": "object", "properties": {"a": {}}, "unevaluatedItems": False,
                           "unevaluatedProperties": False}}},
     {"unevaluatedProperties at #/properties/x/unevaluatedProperties",
      "unevaluatedItems at #/properties/x/unevaluatedItems"}),
    ({"$id": "http://example.com/s.json", "$defs": {"n": {"$anchor": "n", "type": "integer"}},
      "properties": {"a": {"$ref": "#n"}}}, {"$ref at #/properties/a/$ref"}),
    ({"allOf": [{"properties": {"a": {}}, "unevaluatedProperties": False}, {"required": ["b"]}]}, set()),
    ({"not": {"properties": {"a": {}}, "unevaluatedProperties": False}}, set()),
    (SCHEMAS[27][0], {"unevaluatedProperties at #/unevaluatedProperties", "dependentRequired at #/dependentRequired"}),
]


@pytest.mark.parametrize("schema,enforced", ENFORCED, ids=[json.dumps(s)[:50] for s, _ in ENFORCED])
def test_enforced_by_rewrite_names_validation_only_keywords_the_grammar_now_enforces(schema, enforced):
    text = json.dumps(schema)
    assert enforced_by_rewrite(text) == enforced
    assert enforced <= set(validation_only_keywords(text)) | {"$ref at #/properties/a/$ref"}
    assert enforced_by_rewrite(None) == set()


@pytest.mark.parametrize("pattern", ["a+", "^a+", "a+$", "^a+$", "^x|y$", "(a|b)c", "[|]x", r"x\$", r"x\\$", "", "^$"])
def test_a_searched_pattern_matches_whole_strings_as_the_pattern_matches_anywhere(pattern):
    whole = searched(pattern)
    for text in ["", "a", "aa", "xaay", "ac", "bc", "xbcx", "|x", "x$", "x\\", "x", "y", "zy", "xz", "$"]:
        assert bool(re.fullmatch(whole, text)) == bool(re.search(pattern, text)), (whole, text)


@pytest.mark.parametrize("pattern,counted", [
    (r"^1(-a+)?$", r"^1(-a+){0,1}$"), (r"^x(ab)??y$", r"^x(ab){0,1}?y$"), (r"\)?a", r"\)?a"),
    (r"[)]?(a)?", r"[)]?(a){0,1}"), (r"[]a)]?(b)?", r"[]a)]?(b){0,1}"), (r"((a)?b)?", r"((a){0,1}b){0,1}"),
])
def test_optional_groups_are_counted_in_the_same_language(pattern, counted):
    assert optional_groups_counted(pattern) == counted
    for text in ["", "1", "1a", "1-a", "1-aa", "xy", "xaby", ")", ")a", "a", "b", "ab", "]", "]b", "aab"]:
        assert bool(re.fullmatch(pattern, text)) == bool(re.fullmatch(counted, text)), text


def test_the_grammar_takes_the_rewritten_forms():
    """Valid instances xgrammar refused under the schemas as written: compiled from the rewrites,
    it accepts them, and still refuses the invalid ones."""
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    def accepts(schema, text):
        grammar = xgrammar.Grammar.from_json_schema(grammar_schema(json.dumps(schema)), any_whitespace=False,
                                                    strict_mode=True)
        return _is_grammar_accept_string(grammar, text)

    assert accepts({"const": 0}, "0.0") and not accepts({"const": 0}, "1")
    pattern = {"type": "string", "pattern": "a+"}
    assert accepts(pattern, '"xaay"') and not accepts(pattern, '"y"')
    assert accepts({"properties": {"a": {}}}, "12") and accepts({"unevaluatedProperties": False}, '"s"')
    dependent = SCHEMAS[14][0]
    assert accepts(dependent, '{"a": 1, "b": 2}') and accepts(dependent, '{"b": 2}')
    assert not accepts(dependent, '{"a": 1}')
    discriminated = SCHEMAS[19][0]
    assert accepts(discriminated, '{"kind": "a", "a": 1}') and not accepts(discriminated, '{"kind": "a", "b": 1}')
    recursive = {"properties": {"next": {"$ref": "#"}}, "additionalProperties": False}
    assert accepts(recursive, '{"next": {"next": false}}') and not accepts(recursive, '{"other": 1}')
