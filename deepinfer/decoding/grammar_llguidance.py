"""llguidance as a grammar backend: strict JSON schemas, and its matcher behind xgrammar's interface.

xgrammar's strict mode refuses properties an object schema does not list and items past a
tuple's ``prefixItems``; llguidance follows the JSON-Schema default (extra ones allowed), so the
schema it compiles says ``additionalProperties: false`` / ``items: false`` where xgrammar's strict
mode would assume them (:func:`llguidance_schema`). Both backends then accept the same outputs for
the same schema wherever both enforce it. Its regexes read ``\\d``, ``\\w`` and ``\\s`` as Unicode
classes; patterns handed to it say the ASCII classes xgrammar and ECMA-262 mean
(:func:`ascii_classes`)."""
from __future__ import annotations

import json
from typing import Any

_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_OPEN_ARRAY = ("items", "additionalItems", "unevaluatedItems")
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "not")
_BESIDE = ("properties", "prefixItems", "items", "allOf", "$ref")
"""Keywords of a schema that combine with its ``anyOf`` / ``oneOf`` branches (which then stay open)."""
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
              "else", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\s`` (and, outside brackets, ``\\D``, ``\\W``,
    ``\\S``) written as the ASCII classes they mean in ECMA-262 and xgrammar."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            name = pattern[i + 1]
            if name.lower() in _ASCII and (name.islower() or not in_class):
                body = _ASCII[name.lower()]
                out.append(body if in_class else f"[{'' if name.islower() else '^'}{body}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            if pattern[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1:i + 2] == "]":
                out.append("]")
                i += 1
        else:
            in_class = in_class and char != "]"
            out.append(char)
        i += 1
    return "".join(out)


def llguidance_schema(schema: str) -> str:
    """``schema`` (JSON text) as llguidance compiles it: xgrammar's strict mode written out (an
    object schema listing ``properties`` and leaving extra properties unsaid gets
    ``additionalProperties: false``; a ``prefixItems`` tuple leaving extra items unsaid gets
    ``items: false``), patterns in ASCII
    classes (:func:`ascii_classes`), and ``format`` only beside ``"type": "string"``, where
    xgrammar asserts it too (elsewhere it stays the annotation JSON Schema makes it by default).
    Schemas another one intersects with (``allOf`` entries and their parents, schemas beside an
    applicator, the targets of references made inside an ``allOf``) stay open, since closing one
    would refuse properties its partner lists."""
    document = json.loads(schema)
    if not isinstance(document, dict):
        return schema
    shared_refs: set[str] = set()
    _refs_under_all_of(document, False, shared_refs)
    return json.dumps(_close(document, False, "#", shared_refs))


def _refs_under_all_of(node: Any, inside: bool, found: set[str]) -> None:
    if isinstance(node, dict):
        if inside and isinstance(node.get("$ref"), str):
            found.add(node["$ref"])
        for key, child in node.items():
            _refs_under_all_of(child, inside or key == "allOf", found)
    elif isinstance(node, list):
        for child in node:
            _refs_under_all_of(child, inside, found)


def _close(node: Any, shared: bool, pointer: str, shared_refs: set[str]) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node) if node.get("type") == "string" else {k: v for k, v in node.items() if k != "format"}
    if isinstance(node.get("pattern"), str):
        out["pattern"] = ascii_classes(node["pattern"])
    shared_here = shared or pointer in shared_refs or any(k in node for k in _APPLICATORS)
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            out[key] = _close(node[key], False, f"{pointer}/{key}", shared_refs)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            rename = ascii_classes if key == "patternProperties" else str
            out[key] = {rename(name): _close(child, False, f"{pointer}/{key}/{name}", shared_refs)
                        for name, child in node[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            inner = key == "allOf" or (key in ("anyOf", "oneOf") and (shared or any(k in node for k in _BESIDE)))
            out[key] = [_close(child, inner, f"{pointer}/{key}/{i}", shared_refs) for i, child in enumerate(node[key])]
    if not shared_here:
        if "properties" in node and not any(k in node for k in _OPEN_OBJECT):
            out["additionalProperties"] = False
        if isinstance(node.get("prefixItems"), list) and not any(k in node for k in _OPEN_ARRAY):
            out["items"] = False
    return out


class LLGuidanceMatcher:
    """An llguidance ``LLMatcher`` with xgrammar's ``GrammarMatcher`` interface, as the engine
    uses it: a refused token leaves the state as it was, a stop token is accepted once the
    grammar may end (then :meth:`is_terminated`), and :meth:`rollback` undoes any number of
    accepted tokens, stop tokens included."""

    def __init__(self, matcher, stop_ids):
        self._matcher, self._stops = matcher, frozenset(stop_ids)
        self._accepted: list[bool] = []  # per accepted token: whether it was a stop token

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, index)

    def accept_token(self, token: int) -> bool:
        if self.is_terminated():
            return False
        if token in self._stops:
            if not self._matcher.is_accepting():
                return False
        elif self._matcher.validate_tokens([token]) != 1 or not self._matcher.consume_token(token):
            return False
        self._accepted.append(token in self._stops)
        return True

    @property
    def error(self) -> str | None:
        """Why llguidance stopped matching (a parser limit), or None."""
        return self._matcher.get_error().splitlines()[0] if self._matcher.is_error() else None

    def is_terminated(self) -> bool:
        return bool(self._accepted) and self._accepted[-1]

    def rollback(self, num_tokens: int) -> None:
        undone = self._accepted[len(self._accepted) - num_tokens:]
        del self._accepted[len(self._accepted) - num_tokens:]
        consumed = sum(not stop for stop in undone)
        if consumed:
            self._matcher.rollback(consumed)

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted.clear()
