"""The last word on a structured JSON output: it parses, and it validates against its schema
with ``jsonschema`` under the schema's own draft (``$schema``; 2020-12 when it names none).

The grammar enforces most of a schema while tokens are chosen; what it cannot (``not``,
``uniqueItems``, ``oneOf``'s exclusivity, ...) is checked here once the output is complete, so a
request never ends "stop" with JSON its schema rejects."""
from __future__ import annotations

import json
from typing import Any

from deepinfer.decoding.schema_rewrite import merge_all_of

UNENFORCED = ("not", "contains", "minContains", "maxContains", "if", "then", "else", "dependentRequired",
              "dependentSchemas", "dependencies", "propertyNames", "patternProperties", "unevaluatedProperties",
              "unevaluatedItems", "$dynamicRef")
"""Keywords xgrammar 0.2.9's JSON-schema grammar leaves out wherever they appear (``oneOf`` is
enforced as ``anyOf``, without its exclusivity; ``uniqueItems: true`` is left out too)."""
COMBINED = ("type", "properties", "required")
"""Keywords xgrammar leaves out beside ``anyOf`` / ``oneOf`` / ``allOf`` (an ``allOf`` whose
entries merge into the schema is rewritten away first, :mod:`deepinfer.decoding.schema_rewrite`,
as are type-specific keywords in a subschema without ``"type"``)."""
LLGUIDANCE_UNENFORCED = tuple(k for k in UNENFORCED if k != "patternProperties")
"""Keywords llguidance 1.9 leaves out (it names them in its warnings); it enforces
``patternProperties``, ``allOf``, keywords beside applicators, and ``$ref`` through ``$id`` and
anchors, and reads ``oneOf`` as ``anyOf`` and ``uniqueItems`` not at all, as xgrammar does."""
BACKENDS = ("xgrammar", "llguidance")
DRAFT7 = "http://json-schema.org/draft-07/schema#"
_CHILD = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "items",
          "unevaluatedProperties", "unevaluatedItems")
_CHILDREN = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def json_validator(schema: str | None):
    """A validator for the JSON schema text ``schema`` (None: any JSON, no validator). Raises
    ValueError, naming the keyword and its path, when the schema breaks its own metaschema."""
    if schema is None:
        return None
    import jsonschema

    try:
        document = json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"the JSON schema is not JSON: {error.msg} at character {error.pos}") from None
    if isinstance(document, bool):
        return jsonschema.Draft202012Validator(document)
    cls = jsonschema.validators.validator_for(document, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(document)
    except jsonschema.SchemaError as error:
        raise ValueError(f"the JSON schema is not valid under {cls.__name__}: {error.message} (keyword "
                         f"{error.validator!r} at {_pointer(error.absolute_path)})") from None
    return cls(document)


def read_json_schema(schema: str | None):
    """``(schema, validator)`` of the JSON schema text ``schema`` (:func:`json_validator`); only
    when that refuses it is the draft inferred (:func:`with_inferred_draft`), the schema then
    returned naming it. Raises ValueError as :func:`json_validator` does."""
    try:
        return schema, json_validator(schema)
    except ValueError:
        inferred = with_inferred_draft(schema)
        if inferred == schema:
            raise
        return inferred, json_validator(inferred)


def with_inferred_draft(schema: str | None) -> str | None:
    """``schema`` as given, unless it names no ``$schema``, breaks the 2020-12 metaschema (the
    draft assumed then) and keeps draft 7's (array-form ``items``, ``additionalItems``,
    ``dependencies``): then the same schema naming draft 7, so its rewrite and validation read it
    as written for that draft."""
    if schema is None:
        return None
    import jsonschema

    try:
        document = json.loads(schema)
    except json.JSONDecodeError:
        return schema
    if not isinstance(document, dict) or "$schema" in document:
        return schema
    if jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA).is_valid(document):
        return schema
    if not jsonschema.Draft7Validator(jsonschema.Draft7Validator.META_SCHEMA).is_valid(document):
        return schema
    return json.dumps({"$schema": DRAFT7, **document})


def json_violation(text: str, validator) -> str | None:
    """Why ``text`` is not a JSON value its schema accepts (``validator``, None for any JSON), or
    None: the first error ``jsonschema`` ranks best, with its keyword, the instance path and the
    schema path."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as error:
        return f"the output is not JSON: {error.msg} at character {error.pos}"
    if validator is None:
        return None
    import jsonschema

    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except Exception as failure:  # e.g. a $ref that cannot be resolved: unvalidated output must not end "stop"
        return f"the output could not be validated against its JSON schema: {_short(failure)}"
    if error is None:
        return None
    return (f"the output breaks its JSON schema: keyword {error.validator!r} at {_json_path(error.absolute_path)} "
            f"(schema {_pointer(error.absolute_schema_path)}): {_short(error.message)}")


def validation_only_keywords(schema: str | None, backend: str = "xgrammar") -> list[str]:
    """The keywords of the JSON schema text ``schema`` that ``backend``'s grammar does not
    enforce, so only the finished output's validation does, each as ``"keyword at #/path"``
    (see :data:`UNENFORCED`, :data:`COMBINED` and :data:`LLGUIDANCE_UNENFORCED`; under xgrammar
    also ``$ref`` other than a local JSON pointer)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown grammar backend {backend!r}; expected one of {list(BACKENDS)}")
    if schema is None:
        return []
    found: list[str] = []
    _walk(json.loads(schema), (), found, backend == "xgrammar")
    return found


def _walk(node, path: tuple, found: list[str], xgrammar: bool) -> None:
    if not isinstance(node, dict):
        return
    here = lambda key: f"{key} at {_pointer((*path, key))}"  # noqa: E731
    found += [here(k) for k in (UNENFORCED if xgrammar else LLGUIDANCE_UNENFORCED) if k in node]
    if node.get("oneOf") is not None:
        found.append(f"oneOf exclusivity at {_pointer((*path, 'oneOf'))}")
    if node.get("uniqueItems") is True:
        found.append(here("uniqueItems"))
    ref = node.get("$ref")
    if xgrammar and isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append(here("$ref"))
    if xgrammar and (any(k in node for k in ("anyOf", "oneOf")) or "allOf" in merge_all_of(node)):
        found += [here(k) for k in COMBINED if k in node]
    for key in _CHILD:
        if isinstance(node.get(key), dict):
            _walk(node[key], (*path, key), found, xgrammar)
    for key in _CHILDREN:
        for name, child in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            _walk(child, (*path, key, name), found, xgrammar)
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for index, child in enumerate(node[key]):
                _walk(child, (*path, key, index), found, xgrammar)


def _json_path(parts) -> str:
    path = "$"
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _pointer(parts) -> str:
    return "#/" + "/".join(str(p) for p in parts)


def _short(message: Any, limit: int = 200) -> str:
    text = str(message)
    return text if len(text) <= limit else text[:limit] + "..."
