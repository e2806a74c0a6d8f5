"""JSON schemas rewritten for the grammar into equivalents it enforces.

The grammar compiler (xgrammar) leaves out some keywords and refuses some forms; where an
equivalent form exists, the grammar gets that instead (the finished output is still validated
against the schema as written, :mod:`deepinfer.decoding.schema_check`):

* string, number and array keywords in a subschema without ``"type"`` (``{"minLength": 2}``
  constrains only strings) become ``anyOf`` of each keyword family under its type, beside the
  types it leaves free (:data:`FAMILIES`); a ``propertyNames`` schema without one is a string's;
* draft-7's array form of ``items`` (with ``additionalItems``) becomes ``prefixItems`` (with ``items``);
* ``allOf`` entries whose keywords do not overlap the schema's own merge into it (``properties``
  of distinct names and ``required`` lists combine);
* integral decimals of count keywords (``"minItems": 1.0``) become integers, and a pattern's
  optional groups are counted (:func:`optional_groups_counted`);
* an object's ``minProperties`` above its named properties, with ``additionalProperties``
  unsaid, says it (``true``): the grammar's strict mode would otherwise allow none beyond them;
* boolean subschemas: ``true`` becomes ``{}``; a ``false`` tuple position ends the tuple there
  (``maxItems``); a ``false`` property is dropped from
  ``properties`` (strict mode then refuses it), ``items: false`` is dropped after
  ``prefixItems`` (strict mode refuses extra items) and becomes ``maxItems: 0`` otherwise, a
  ``false`` branch of ``anyOf`` / ``oneOf`` is dropped.
"""
from __future__ import annotations

import json
from typing import Any

FAMILIES = {
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("items", "minItems", "maxItems"),
}
"""Type-specific keywords the grammar enforces once their type is named (``number`` covers
``integer``). Object keywords are left alone: naming the type would make the grammar's strict
mode refuse properties the schema allows."""
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains")
"""Count keywords, whose integral decimals (``2.0``) the grammar reads as integers."""
OTHER_TYPES = ("string", "number", "boolean", "null", "array", "object")
_DECIDED = ("type", "$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not", "if", "$dynamicRef")
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_MANY = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def grammar_schema(schema: str | None) -> str | None:
    """The JSON schema text to compile for ``schema`` (unchanged when nothing applies, or when a
    rewrite would break one of its local ``$ref`` pointers)."""
    if schema is None:
        return None
    document = json.loads(schema)
    rewritten = _rewrite(document)
    if rewritten == document or not all(_resolves(rewritten, ref) for ref in _local_refs(rewritten)):
        return schema
    return json.dumps(rewritten)


def _local_refs(node: Any):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            yield ref
        for value in node.values():
            yield from _local_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _local_refs(value)


def _resolves(document: Any, ref: str) -> bool:
    node = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _rewrite(node: Any) -> Any:
    if node is True:
        return {}
    if not isinstance(node, dict):
        return node
    node = merge_all_of(dict(node))
    if isinstance(node.get("pattern"), str):
        node["pattern"] = optional_groups_counted(node["pattern"])
    for key in COUNTS:
        if isinstance(node.get(key), float) and node[key].is_integer():
            node[key] = int(node[key])
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    names = node.get("propertyNames")
    if isinstance(names, dict) and not any(key in names for key in _DECIDED):
        node["propertyNames"] = {"type": "string", **names}  # names are strings
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
    prefix = node.get("prefixItems")
    if isinstance(prefix, list) and False in prefix:
        cut = prefix.index(False)
        node["maxItems"] = min(node.get("maxItems", cut), cut)
        node.pop("items", None)
        if cut:
            node["prefixItems"] = prefix[:cut]
        else:
            del node["prefixItems"]
    if node.get("items") is False:
        del node["items"]
        if "prefixItems" not in node:
            node["maxItems"] = 0
    named = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if node.get("type") == "object" and isinstance(node.get("minProperties"), int) \
            and node["minProperties"] > len(named) and "additionalProperties" not in node \
            and "patternProperties" not in node:
        node["additionalProperties"] = True
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and False in node[key] and any(c is not False for c in node[key]):
            node[key] = [child for child in node[key] if child is not False]
    return _typed(node)


def optional_groups_counted(pattern: str) -> str:
    """``pattern`` with each optional group ``(...)?`` written ``(...){0,1}`` (the same language):
    xgrammar 0.2.9's JSON-schema patterns make the prefix of an optional group optional too
    (``^1(-a+)?$`` accepts ``"1a"``), and read the counted form right."""
    out, index, in_class = [], 0, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            out.append(pattern[index:index + 2])
            index += 2
            continue
        if in_class:
            in_class = char != "]" or pattern[index - 1] == "["
        elif char == "[":
            in_class = True
        elif char == ")" and pattern[index + 1:index + 2] == "?":
            out.append("){0,1}")
            index += 2
            continue
        out.append(char)
        index += 1
    return "".join(out)


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
    for branch in branches:
        if branch["type"] == "array" and "items" not in branch:
            branch["items"] = {}  # strict mode reads an array without items as empty
    branches += [{"type": t} for t in OTHER_TYPES if t not in families]
    return {**shared, "anyOf": branches}
