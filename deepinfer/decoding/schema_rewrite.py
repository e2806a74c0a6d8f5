"""JSON schemas rewritten for the grammar into equivalents it enforces.

The grammar compilers leave out some keywords and refuse some forms; where an equivalent form
exists, the grammar gets that instead (the finished output is still validated against the schema
as written, :mod:`deepinfer.decoding.schema_check`). The grammar reads an object schema in strict
mode (no properties beyond those it names, unless ``additionalProperties``,
``patternProperties`` or ``unevaluatedProperties`` say otherwise), and the rewrites keep that:

* ``$ref`` resolved (:mod:`deepinfer.decoding.schema_refs`), and each draft's keywords written in
  2020-12's: draft-7 ``items`` arrays (with ``additionalItems``) as ``prefixItems`` (with
  ``items``), ``dependencies`` as ``dependentRequired`` / ``dependentSchemas``, draft-4 boolean
  exclusive bounds as numbers; keywords the draft does not have are left out;
* ``allOf`` entries whose keywords do not overlap the schema's own merge into it (``properties``
  of distinct names and ``required`` lists combine);
* an object's ``if`` / ``then`` / ``else``, ``dependentRequired``, ``dependentSchemas``, and
  ``anyOf`` / ``oneOf`` beside its own keywords, become ``anyOf`` of plain objects where that is
  exact (:mod:`deepinfer.decoding.schema_branches`);
* ``unevaluatedProperties`` / ``unevaluatedItems`` of a schema without in-place applicators become
  ``additionalProperties`` / ``items``; beside one they become ``true`` (validation enforces them);
* a ``const`` or ``enum`` value holding integral numbers accepts their other spellings (``1.0``
  for ``1``) through ``minimum`` = ``maximum``;
* a pattern matches anywhere in the string (``a+`` becomes ``^.*a+.*$``), its optional groups
  counted (:func:`optional_groups_counted`); integral decimals of count keywords become integers;
* type-specific keywords in a subschema without ``"type"`` (``{"minLength": 2}`` constrains only
  strings) become ``anyOf`` of each keyword family under its type, beside the types it leaves free
  (:data:`FAMILIES`); a ``propertyNames`` schema without one is a string's; an object naming no
  properties lists those it requires (it stays open);
* an object's ``minProperties`` above its named properties, with ``additionalProperties``
  unsaid, says it (``true``);
* boolean subschemas: ``true`` becomes ``{}``; a ``false`` tuple position ends the tuple there
  (``maxItems``); a ``false`` property is dropped from ``properties`` (strict mode then refuses
  it), ``items: false`` is dropped after ``prefixItems`` and becomes ``maxItems: 0`` otherwise, a
  ``false`` branch of ``anyOf`` / ``oneOf`` is dropped.

:func:`enforced_by_rewrite` names the keywords these rewrites leave the grammar enforcing."""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from deepinfer.decoding.schema_branches import expand, merge_all_of
from deepinfer.decoding.schema_refs import (NOWHERE, SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS, Provenance, draft_of,
                                            local_refs, pointed, resolve_refs)

FAMILIES = {
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "contains", "minContains", "maxContains", "uniqueItems"),
    "object": ("properties", "additionalProperties", "required", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas"),
}
"""Type-specific keywords the grammar enforces once their type is named (``number`` covers ``integer``)."""
RIDERS = ("contains", "minContains", "maxContains", "uniqueItems", "required", "patternProperties", "minProperties",
          "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas")
"""Family keywords that go with their type's branch but call for none (without one they stay
beside the branches): the grammar reads a schema holding only them as any JSON value."""
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains")
"""Count keywords, whose integral decimals (``2.0``) the grammar reads as integers."""
OTHER_TYPES = ("string", "number", "boolean", "null", "array", "object")
DRAFT_KEYWORDS = {"prefixItems": (2020, 9999), "unevaluatedProperties": (2019, 9999), "unevaluatedItems": (2019, 9999),
                  "dependentRequired": (2019, 9999), "dependentSchemas": (2019, 9999), "if": (7, 9999),
                  "then": (7, 9999), "else": (7, 9999), "const": (6, 9999), "contains": (6, 9999),
                  "propertyNames": (6, 9999), "dependencies": (0, 7), "additionalItems": (0, 2019)}
"""The drafts (first, last) that have each keyword the rewrite reads; elsewhere it means nothing."""
EXACT_NUMBERS = 16
"""The most numbers of one ``enum`` written as ranges."""
ANNOTATIONS = ("$defs", "$comment", "title", "description", "default", "examples")
"""Keywords beside a ``const`` / ``enum`` that leave its values as they are."""
_DECIDED = ("type", "$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not", "if", "$dynamicRef")
_IN_PLACE = ("allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
             "dependentSchemas")


def grammar_schema(schema: str | None) -> str | None:
    """The JSON schema text to compile for ``schema`` (unchanged when nothing applies, or when a
    rewrite would break one of its local ``$ref`` pointers)."""
    return None if schema is None else _rewritten(schema)[0]


def enforced_by_rewrite(schema: str | None) -> set[str]:
    """The ``"keyword at #/path"`` entries (paths into ``schema`` as written, as
    :func:`~deepinfer.decoding.schema_check.validation_only_keywords` writes them) that
    :func:`grammar_schema` turns into equivalents the grammar enforces. Raises ValueError when
    ``schema`` is not JSON, as :func:`grammar_schema` does."""
    return set() if schema is None else set(_rewritten(schema)[1])


@functools.lru_cache(maxsize=256)
def _rewritten(schema: str) -> tuple[str, frozenset[str]]:
    document = json.loads(schema)
    try:
        draft = draft_of(document)
        resolved, provenance = resolve_refs(document, draft)
        _in_2020_vocabulary(resolved, draft, provenance)
        rewritten = _rewrite(resolved, provenance)
    except Exception:  # a schema this cannot read goes as written: its compile or validation names the error
        return schema, frozenset()
    if rewritten == document or any(pointed(rewritten, ref) is NOWHERE for ref in local_refs(rewritten)):
        return schema, frozenset()
    return json.dumps(rewritten), frozenset(provenance.enforced(rewritten))


def _in_2020_vocabulary(node: Any, draft: int, provenance: Provenance) -> None:
    """``node`` (resolved, so its own copy) and its subschemas, in place, in 2020-12's keywords."""
    if not isinstance(node, dict):
        return
    for key, (first, last) in DRAFT_KEYWORDS.items():
        if key in node and not first <= draft <= last:
            provenance.claim(node, key, anywhere=True)
            del node[key]
    if draft <= 4:
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if isinstance(node.get(exclusive), bool) and node.pop(exclusive) and bound in node:
                node[exclusive] = node.pop(bound)
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    node.pop("additionalItems", None)
    if isinstance(node.get("dependencies"), dict):
        for key, kind in (("dependentRequired", list), ("dependentSchemas", (dict, bool))):
            chosen = {name: value for name, value in node["dependencies"].items() if isinstance(value, kind)}
            if chosen:
                node[key] = chosen
                provenance.rename(node, "dependencies", key)
        del node["dependencies"]
    for child in _children(node):
        _in_2020_vocabulary(child, draft, provenance)


def _children(node: dict):
    for key in SUBSCHEMA:
        if isinstance(node.get(key), dict):
            yield node[key]
    for key in SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()
    for key in SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]


def _rewrite(node: Any, provenance: Provenance) -> Any:
    if node is True:
        return {}
    if not isinstance(node, dict):
        return node
    node = provenance.derive(dict(node), node)
    while (merged := merge_all_of(node)) is not node:
        node = provenance.derive(merged, node, *node["allOf"])
    node = exact_numbers(node)
    node = expand(node, provenance) or node
    _unevaluated(node, provenance)
    if isinstance(node.get("pattern"), str):
        node["pattern"] = searched(optional_groups_counted(node["pattern"]))
    for key in COUNTS:
        if isinstance(node.get(key), float) and node[key].is_integer():
            node[key] = int(node[key])
    names = node.get("propertyNames")
    if isinstance(names, dict) and not any(key in names for key in _DECIDED):
        node["propertyNames"] = {"type": "string", **names}  # names are strings
    _rewrite_children(node, provenance)
    _without_false(node)
    named = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if node.get("type") == "object" and not any(k in node for k in ("additionalProperties", "patternProperties",
                                                                    "unevaluatedProperties")):
        if isinstance(node.get("minProperties"), int) and node["minProperties"] > len(named):
            node["additionalProperties"] = True
        if "properties" not in node and isinstance(node.get("required"), list) and node["required"]:
            node.update(properties={name: {} for name in node["required"]}, additionalProperties=True)
    return provenance.derive(_typed(node), node)


def _rewrite_children(node: dict, provenance: Provenance) -> None:
    for key in SUBSCHEMA:
        if isinstance(node.get(key), (dict, bool)):
            node[key] = _rewrite(node[key], provenance)
    for key in SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _rewrite(child, provenance) for name, child in node[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_rewrite(child, provenance) for child in node[key]]


def _without_false(node: dict) -> None:
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
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and False in node[key] and any(c is not False for c in node[key]):
            node[key] = [child for child in node[key] if child is not False]


def _unevaluated(node: dict, provenance: Provenance) -> None:
    """``unevaluatedProperties`` / ``unevaluatedItems`` as ``additionalProperties`` / ``items``
    where no in-place applicator (nor, for items, ``contains``) can evaluate anything. Beside one,
    the grammar cannot tell what it evaluates, so it allows what the keyword might refuse (left to
    validation): it would read the keyword as the plain one and refuse what an applicator allows."""
    for key, plain, after in (("unevaluatedProperties", "additionalProperties", ()),
                              ("unevaluatedItems", "items", ("contains",))):
        if key not in node:
            continue
        if any(k in node for k in (*_IN_PLACE, *after)):
            del node[key]
            node.setdefault(plain, True)
        else:
            provenance.claim(node, key)
            node.setdefault(plain, node.pop(key))


def exact_numbers(node: dict) -> dict:
    """``node`` with a ``const`` / ``enum`` holding integral numbers written as schemas that accept
    each number's every spelling (``1``, ``1.0``, ``1.00``), when it says nothing else."""
    key = "const" if "const" in node else "enum" if isinstance(node.get("enum"), list) else None
    if key is None or set(node) - {key, "type", *ANNOTATIONS}:
        return node
    values = [node["const"]] if key == "const" else node["enum"]
    if not any(_integral_inside(v) for v in values) or len(values) > EXACT_NUMBERS:
        return node
    import jsonschema

    of_type = jsonschema.Draft202012Validator({"type": node["type"]}) if "type" in node else None
    typed = [v for v in values if of_type is None or of_type.is_valid(v)]
    if not typed:
        return node
    plain = [v for v in typed if not _integral_inside(v)]
    branches = [_value_schema(v) for v in typed if _integral_inside(v)] + ([{"enum": plain}] if plain else [])
    rest = {k: v for k, v in node.items() if k not in (key, "type")}
    return {**rest, **branches[0]} if len(branches) == 1 else {**rest, "anyOf": branches}


def _integral_inside(value: Any) -> bool:
    if isinstance(value, list):
        return any(_integral_inside(v) for v in value)
    if isinstance(value, dict):
        return any(_integral_inside(v) for v in value.values())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() \
        and abs(value) <= 2 ** 53


def _value_schema(value: Any) -> dict:
    if not _integral_inside(value):
        return {"const": value}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [_value_schema(v) for v in value], "minItems": len(value),
                "items": False}
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _value_schema(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    return {"type": "number", "minimum": int(value), "maximum": int(value)}


def searched(pattern: str) -> str:
    """``pattern`` (matched anywhere in a string, as JSON Schema reads it) as a match of the whole
    string, the only way the grammar reads one: each top-level alternative not anchored at an end
    gets ``.*`` there. Leading inline flags (``(?i)``) stay in front."""
    flags = _LEADING_FLAGS.match(pattern)
    if flags:
        return flags.group(0) + searched(pattern[flags.end():])
    bars = [index for index, char, depth in _syntax(pattern) if char == "|" and depth == 0]
    starts, ends = [0, *(i + 1 for i in bars)], [*bars, len(pattern)]
    whole = [_anchored(pattern[start:end]) for start, end in zip(starts, ends)]
    if len(whole) == 1:
        return pattern if pattern.startswith("^") and whole[0] == pattern[1:-1] else f"^{whole[0]}$"
    return "^(?:" + "|".join(whole) + ")$"


_LEADING_FLAGS = re.compile(r"^\(\?[a-zA-Z]+\)")


def _anchored(alternative: str) -> str:
    head = alternative[1:] if alternative.startswith("^") else ".*" + alternative
    body = head[:-1]
    if head.endswith("$") and (len(body) - len(body.rstrip("\\"))) % 2 == 0:
        return body
    return head + ".*"


def optional_groups_counted(pattern: str) -> str:
    """``pattern`` with each optional group ``(...)?`` written ``(...){0,1}`` (the same language):
    xgrammar 0.2.9's JSON-schema patterns make the prefix of an optional group optional too
    (``^1(-a+)?$`` accepts ``"1a"``), and read the counted form right."""
    out, start = [], 0
    for index, char, _ in _syntax(pattern):
        if char == ")" and pattern[index + 1:index + 2] == "?":
            out += [pattern[start:index], "){0,1}"]
            start = index + 2
    return "".join(out) + pattern[start:]


def _syntax(pattern: str):
    """``(index, char, depth)`` of each character of ``pattern`` outside escapes and character
    classes, ``depth`` counting the groups around it."""
    index, depth, in_class = 0, 0, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if in_class:
            in_class = char != "]" or pattern[index - 1] == "["
        elif char == "[":
            in_class = True
        else:
            depth -= char == ")"
            yield index, char, depth
            depth += char == "("
        index += 1


def _typed(node: dict) -> dict:
    if any(key in node for key in _DECIDED):
        return node
    families = [t for t, keywords in FAMILIES.items() if any(k in node and k not in RIDERS for k in keywords)]
    if not families:
        return node
    shared = {k: v for k, v in node.items() if not any(k in FAMILIES[t] for t in families)}
    branches = [{"type": t, **{k: v for k, v in node.items() if k in FAMILIES[t]}} for t in families]
    for branch in branches:
        if branch["type"] == "array" and "items" not in branch and "prefixItems" not in branch:
            branch["items"] = {}  # strict mode reads an array without items as empty
    branches += [{"type": t} for t in OTHER_TYPES if t not in families]
    return {**shared, "anyOf": branches}
