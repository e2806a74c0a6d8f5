"""JSON schemas rewritten for the grammar into equivalents it enforces.

The grammar compiler (xgrammar) leaves out some keywords and refuses some forms; where an
equivalent form exists, the grammar gets that instead (the finished output is still validated
against the schema as written, :mod:`deepinfer.decoding.schema_check`):

* type-specific keywords in a subschema without ``"type"`` (``{"minLength": 2}`` constrains only
  strings) become ``anyOf`` of each keyword family under its type, beside the types it leaves free;
* draft-7's array form of ``items`` (with ``additionalItems``) becomes ``prefixItems`` (with ``items``);
* ``allOf`` entries whose keywords do not overlap the schema's own merge into it (``properties``
  of distinct names and ``required`` lists combine);
* boolean subschemas: ``true`` becomes ``{}``; a ``false`` property is dropped from
  ``properties`` (strict mode then refuses it), ``items: false`` is dropped after
  ``prefixItems`` (strict mode refuses extra items) and becomes ``maxItems: 0`` otherwise, a
  ``false`` branch of ``anyOf`` / ``oneOf`` is dropped.
"""
from __future__ import annotations

import json
from typing import Any

FAMILIES = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains", "minContains",
              "maxContains", "uniqueItems"),
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties",
               "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies"),
}
"""Keywords that constrain one JSON type only (``number`` covers ``integer``)."""
OTHER_TYPES = ("string", "number", "boolean", "null", "array", "object")
_DECIDED = ("type", "$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not", "if", "$dynamicRef")
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_MANY = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def grammar_schema(schema: str | None) -> str | None:
    """The JSON schema text to compile for ``schema`` (unchanged when nothing applies)."""
    if schema is None:
        return None
    document = json.loads(schema)
    rewritten = _rewrite(document)
    return schema if rewritten == document else json.dumps(rewritten)


def _rewrite(node: Any) -> Any:
    if node is True:
        return {}
    if not isinstance(node, dict):
        return node
    node = merge_all_of(dict(node))
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    for key in _ONE:
        if key in node:
            node[key] = _rewrite(node[key])
    for key in _MANY:
        if isinstance(node.get(key), dict):
            node[key] = {name: _rewrite(child) for name, child in node[key].items()}
    for key in _LIST:
        if isinstance(node.get(key), list):
            node[key] = [_rewrite(child) for child in node[key]]
    if isinstance(node.get("properties"), dict):
        node["properties"] = {name: child for name, child in node["properties"].items() if child is not False}
    if node.get("items") is False:
        del node["items"]
        if "prefixItems" not in node:
            node["maxItems"] = 0
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and False in node[key] and any(c is not False for c in node[key]):
            node[key] = [child for child in node[key] if child is not False]
    return _typed(node)


def merge_all_of(node: dict) -> dict:
    """``node`` with its ``allOf`` entries merged in, or ``node`` itself when a keyword overlaps."""
    entries = node.get("allOf")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return node
    merged = {k: v for k, v in node.items() if k != "allOf"}
    for entry in entries:
        for key, value in entry.items():
            if key == "properties" and isinstance(merged.get(key), dict) and isinstance(value, dict) \
                    and not set(merged[key]) & set(value):
                merged[key] = {**merged[key], **value}
            elif key == "required" and isinstance(merged.get(key), list) and isinstance(value, list):
                merged[key] = merged[key] + [name for name in value if name not in merged[key]]
            elif key not in merged or merged[key] == value:
                merged[key] = value
            else:
                return node
    return merged


def _typed(node: dict) -> dict:
    if any(key in node for key in _DECIDED):
        return node
    families = [t for t, keywords in FAMILIES.items() if any(k in node for k in keywords)]
    if not families:
        return node
    shared = {k: v for k, v in node.items() if not any(k in keywords for keywords in FAMILIES.values())}
    branches = [{"type": t, **{k: v for k, v in node.items() if k in FAMILIES[t]}} for t in families]
    branches += [{"type": t} for t in OTHER_TYPES if t not in families]
    return {**shared, "anyOf": branches}
