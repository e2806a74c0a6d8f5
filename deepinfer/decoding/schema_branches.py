"""An object schema's conditional keywords written as ``anyOf`` of plain objects, which the grammar
enforces (a step of :mod:`deepinfer.decoding.schema_rewrite`).

The grammar reads an object schema in strict mode: it allows the properties it names, and those
named by the subschemas it applies in place when they apply (as ``unevaluatedProperties: false``
would). Under that reading each expansion here is exact:

* ``dependentRequired: {a: [b]}``: ``a`` absent, or ``a`` and ``b`` required;
* ``dependentSchemas: {a: S}``: ``a`` absent, or ``a`` required and ``S``;
* ``if`` / ``then`` / ``else`` where ``if`` requires properties (``{"required": [x]}``), or holds one
  property to strings, booleans or null (``{"properties": {x: {"const" | "enum": ...}}}``, ``x``
  required or not) and the object's own schema for ``x`` has a finite domain (``enum``, ``const``,
  boolean): ``if`` true with ``then``, or false (``x`` absent, or one of the other values) with
  ``else``;
* ``anyOf`` beside the object's own keywords: each non-empty subset of its branches (every branch
  that applies names properties), up to :data:`SUBSETS_UP_TO` branches, single branches past it
  without ``unevaluatedProperties``; ``oneOf`` alone: each branch.

Every branch holds the object's own keywords and the chosen subschemas merged; an absent property
is a ``false`` one. An expansion needs the object closed (strict with ``properties``, or
``unevaluatedProperties`` / ``additionalProperties`` false), plain subschemas (no in-place
applicators, ``additionalProperties`` or ``patternProperties``), at most :data:`BRANCHES` branches,
and keywords that merge; otherwise the object is left as it is. :func:`merge_all_of` merges an
``allOf`` into its schema the same way."""
from __future__ import annotations

import itertools
import math
from typing import Any

from deepinfer.decoding.schema_refs import Provenance

BRANCHES = 8
"""The most ``anyOf`` branches one object schema expands into."""
SUBSETS_UP_TO = 3
"""The most ``anyOf`` branches expanded into every subset of them."""
SOURCES = ("if", "then", "else", "dependentRequired", "dependentSchemas", "anyOf", "oneOf")
"""The keywords expanded into branches."""
COMBINED = ("type", "properties", "required")
"""Keywords the grammar leaves out beside ``anyOf`` / ``oneOf``, enforced once in every branch."""
TOGETHER = (("if", "then", "else"), ("contains", "minContains", "maxContains"))
"""Keywords read together in one schema (``then`` with its ``if``, ``minContains`` with its ``contains``)."""
_OUTSIDE = ("$defs", "$schema", "$comment", "title", "description", "default", "examples")
_NOT_PLAIN = ("allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
              "dependentRequired", "dependentSchemas", "additionalProperties", "patternProperties",
              "unevaluatedProperties", "unevaluatedItems")
_SCALAR_TYPES = {str: "string", bool: "boolean", type(None): "null"}


class _Unmerged(Exception):
    pass


def expand(node: dict, provenance: Provenance) -> dict | None:
    """``node`` with its conditional keywords expanded into ``anyOf`` (``oneOf`` for a ``oneOf``
    alone), or None when none applies or the expansion would not be exact; ``provenance`` records
    the keywords expanded as enforced where the grammar enforces every branch whole."""
    if not any(key in node for key in SOURCES):
        return None
    base = {k: v for k, v in node.items() if k not in SOURCES and k not in _OUTSIDE and k != "unevaluatedProperties"}
    closure = _closure(node, base)
    if closure is None or any(key in base for key in ("allOf", "$ref", "$dynamicRef", "$recursiveRef",
                                                       "patternProperties")):
        return None
    sources = _sources(node, base, closure)
    if sources is None or math.prod(len(alternatives) for _, alternatives in sources) > BRANCHES:
        return None
    closing = {"unevaluatedProperties": False} if closure == "evaluated" and "unevaluatedProperties" in node else {}
    branches = []
    try:
        for choice in itertools.product(*(alternatives for _, alternatives in sources)):
            parts = [part for chosen in choice for part in chosen]
            branch = _branch(dict(base), parts, closure)
            if branch is not None and {**branch, **closing} not in branches:
                branches.append(provenance.derive({**branch, **closing}, node, *parts))
    except _Unmerged:
        return None
    if not branches:
        return None
    if all(_merges(schema) for branch in branches for schema in branch.get("properties", {}).values()):
        claimed = [key for keys, _ in sources for key in keys]
        provenance.claim(node, *claimed, *(["unevaluatedProperties"] if closure == "own" else []))
    key = "oneOf" if "oneOf" in node and "unevaluatedProperties" not in node else "anyOf"
    return provenance.derive({**{k: node[k] for k in _OUTSIDE if k in node}, key: branches}, node)


def _closure(node: dict, base: dict) -> str | None:
    """``"own"``: only the object's own properties are allowed; ``"evaluated"``: those of the
    subschemas that apply too; None: the object is open (no absent property can be written)."""
    extra, unevaluated = base.get("additionalProperties"), node.get("unevaluatedProperties")
    if extra is False:
        return "own"
    if extra is not None:
        return None
    if unevaluated is False or (unevaluated is None and "properties" in base):
        return "evaluated"
    return None


def _sources(node: dict, base: dict, closure: str) -> list[tuple[tuple, list[list[dict]]]] | None:
    """Each conditional keyword with its alternatives (each a list of schemas to merge)."""
    sources = []
    if "if" in node:
        alternatives = _conditional(node, base, closure)
        if alternatives is None:
            return None
        sources.append((("if", "then", "else"), alternatives))
    elif "then" in node or "else" in node:
        sources.append((("then", "else"), [[]]))
    for key, expanded in (("dependentRequired", _required_alternatives), ("dependentSchemas", _schema_alternatives)):
        if key in node:
            if not isinstance(node[key], dict):
                return None
            for name, value in node[key].items():
                alternatives = expanded(name, value, base)
                if alternatives is None:
                    return None
                sources.append(((key,), alternatives))
    if "anyOf" in node:
        sources.append(_any_of(node, closure))
    if "oneOf" in node:
        if sources or not _plain_list(node["oneOf"]):
            return None
        sources.append((COMBINED, [[entry] for entry in _entries(node["oneOf"])]))
    return None if any(alternatives is None for _, alternatives in sources) else sources


def _required_alternatives(name: str, names: Any, base: dict) -> list[list[dict]] | None:
    if not isinstance(names, list):
        return None
    present = [{"required": [name, *names]}]
    return [present] if name in base.get("required", []) else [[_absent(name)], present]


def _schema_alternatives(name: str, schema: Any, base: dict) -> list[list[dict]] | None:
    if schema is True or schema == {}:
        return [[]]
    if schema is False:
        return [[_absent(name)]]
    if not _plain(schema):
        return None
    present = [{"required": [name]}, schema]
    return [present] if name in base.get("required", []) else [[_absent(name)], present]


def _any_of(node: dict, closure: str) -> tuple[tuple, list[list[dict]] | None]:
    if not _plain_list(node["anyOf"]):
        return (), None
    entries = _entries(node["anyOf"])
    if closure == "own" or (len(entries) > SUBSETS_UP_TO and "unevaluatedProperties" not in node):
        exact = closure == "own"
        return (COMBINED if exact else ()), [[entry] for entry in entries]
    if len(entries) > SUBSETS_UP_TO:
        return (), None
    subsets = [list(s) for size in range(1, len(entries) + 1) for s in itertools.combinations(entries, size)]
    return COMBINED, subsets


def _conditional(node: dict, base: dict, closure: str) -> list[list[dict]] | None:
    then, otherwise = (_schema(node.get(key, {})) for key in ("then", "else"))
    condition = _schema(node["if"])
    if any(part is not None and not _plain(part) for part in (then, otherwise)) \
            or not isinstance(condition, (dict, type(None))):
        return None
    if condition == {}:
        true, false = [[]], []
    elif condition is None:
        true, false = [], [[]]
    else:
        decided = _decided(condition, base, closure, (otherwise or {}).get("properties", {}))
        if decided is None:
            return None
        true, false = decided
    return ([[*parts, then] for parts in true if then is not None]
            + [[*parts, otherwise] for parts in false if otherwise is not None])


def _decided(condition: dict, base: dict, closure: str, else_names) -> tuple[list, list] | None:
    """The alternatives under which ``condition`` (an ``if``) holds, and those under which it does not."""
    required = base.get("required", [])
    if set(condition) == {"required"} and _strings(condition["required"]):
        names = condition["required"]
        return [[{"required": names}]], [[_absent(n)] for n in names if n not in required]
    if not set(condition) <= {"properties", "required"} or not isinstance(condition.get("properties"), dict) \
            or len(condition["properties"]) != 1:
        return None
    (name, held), = condition["properties"].items()
    values = _values(held)
    if values is None or condition.get("required", [name]) not in ([name], []):
        return None
    true = [[{"properties": {name: {"enum": values}}, "required": [name]}]]
    false = []
    if name not in required:
        (false if name in condition.get("required", []) else true).append([_absent(name)])
    domain = _values(base.get("properties", {}).get(name))
    if domain is not None:
        rest = [v for v in domain if not _member(v, values)]
        false += [[{"properties": {name: {"enum": rest}}, "required": [name]}]] if rest else []
    elif name in base.get("properties", {}) or (closure == "evaluated" and name in else_names):
        return None
    return true, false


def _branch(out: dict, parts: list[dict], closure: str) -> dict | None:
    """``out`` (a copy of the object's own keywords) with ``parts`` merged in; None when no object
    can match it (a required property absent or not allowed)."""
    own = set(out.get("properties", {}))
    for part in parts:
        for key, value in part.items():
            if key == "properties":
                properties = dict(out.get("properties", {}))
                for name, schema in value.items():
                    schema = False if closure == "own" and name not in own else schema
                    properties[name] = conjoined(properties[name], schema) if name in properties else schema
                out["properties"] = properties
            elif key == "required":
                out["required"] = [*out.get("required", []), *(n for n in value if n not in out.get("required", []))]
            elif key not in out or out[key] == value:
                out[key] = value
            else:
                raise _Unmerged
    properties = out.get("properties", {})
    if any(properties.get(name, False) is False for name in out.get("required", [])):
        return None
    return out


def conjoined(first: Any, second: Any) -> Any:
    """A schema accepting what both ``first`` and ``second`` accept (an ``{"enum": ...}`` second
    narrows ``first``'s ``enum`` / ``const``)."""
    if first == second or second is True or second == {}:
        return first
    if first is True or first == {}:
        return second
    if first is False or second is False:
        return False
    if isinstance(first, dict) and isinstance(second, dict) and set(second) == {"enum"}:
        allowed = first.get("type")
        allowed = [allowed] if isinstance(allowed, str) else allowed
        values = [v for v in second["enum"] if allowed is None or _SCALAR_TYPES[type(v)] in allowed]
        if "const" in first:
            return first if _member(first["const"], values) else False
        kept = [v for v in first["enum"] if _member(v, values)] if "enum" in first else values
        return {**first, "enum": kept} if kept else False
    return {"allOf": [first, second]}


def _merges(schema: Any) -> bool:
    """Whether the grammar enforces ``schema`` as a whole (an ``allOf`` of it merges)."""
    return not isinstance(schema, dict) or "allOf" not in schema or "allOf" not in merge_all_of(schema)


def _absent(name: str) -> dict:
    return {"properties": {name: False}}


def _values(schema: Any) -> list | None:
    """The strings, booleans or null ``schema`` allows, when it allows only such and finitely many."""
    if not isinstance(schema, dict):
        return None
    named = schema.get("type") if isinstance(schema.get("type"), str) else None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else \
        {"boolean": [True, False], "null": [None]}.get(named)
    if not isinstance(values, list) or not all(type(v) in _SCALAR_TYPES for v in values):
        return None
    return values


def _member(value: Any, values: list) -> bool:
    return any(type(value) is type(other) and value == other for other in values)


def _schema(value: Any) -> dict | None:
    return {} if value is True else None if value is False else value


def _entries(values: list) -> list[dict]:
    return [_schema(v) for v in values if v is not False]


def _plain(schema: Any) -> bool:
    return isinstance(schema, dict) and not any(key in schema for key in _NOT_PLAIN)


def _plain_list(values: Any) -> bool:
    return isinstance(values, list) and all(_plain(e) for e in _entries(values)) and bool(_entries(values))


def _strings(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def merge_all_of(node: dict) -> dict:
    """``node`` with its ``allOf`` entries merged in, or ``node`` itself when a keyword overlaps,
    keywords read together (:data:`TOGETHER`) come from more than one of them, or an entry holds
    ``unevaluatedProperties`` / ``unevaluatedItems`` (merged, it would see more)."""
    entries = node.get("allOf")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries) \
            or any("unevaluatedProperties" in e or "unevaluatedItems" in e for e in entries) \
            or any(sum(any(k in part for k in group) for part in (node, *entries)) > 1 for group in TOGETHER):
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
