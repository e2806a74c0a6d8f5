"""The last word on a structured JSON output: it parses, and it validates against its schema
with ``jsonschema`` under the schema's own draft (``$schema``; 2020-12 when it names none).

The grammar enforces most of a schema while tokens are chosen; what it cannot (``not``,
``uniqueItems``, ``oneOf``'s exclusivity, ...) is checked here once the output is complete, so a
request never ends "stop" with JSON its schema rejects."""
from __future__ import annotations

import json
from typing import Any


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

    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return None
    return (f"the output breaks its JSON schema: keyword {error.validator!r} at {_json_path(error.absolute_path)} "
            f"(schema {_pointer(error.absolute_schema_path)}): {_short(error.message)}")


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
