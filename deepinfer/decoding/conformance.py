"""What the structured-output pipeline does with a given JSON output, without a model.

:func:`pipeline_outcome` compiles the schema as a request would, feeds the output's tokens to the
grammar's matcher, then its end-of-sequence token, and validates the finished text: the same
steps a generated output goes through. The conformance experiment runs the official
JSON-Schema-Test-Suite through it (``experiments/structured_conformance.py``)."""
from __future__ import annotations

import json
from typing import Any

from deepinfer.decoding.grammar_service import GrammarService
from deepinfer.decoding.structured import check_structured

OUTCOMES = ("stop", "compile", "grammar", "validation")
"""``stop``: the output would end "stop"; ``compile``: the schema is refused (compile or
metaschema error); ``grammar``: the grammar refuses the output's tokens; ``validation``: the
grammar accepts them but the finished output breaks the schema (the request ends "error")."""


def canonical_text(value: Any) -> str:
    """``value`` as the strict grammar writes JSON (``", "`` and ``": "`` separators, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def pipeline_outcome(service: GrammarService, tokenizer, schema: Any, text: str,
                     timeout_s: float = 600.0) -> tuple[str, str | None]:
    """``(outcome, reason)`` of ``text`` as the whole output of a request under the JSON
    ``schema`` (a dict or a boolean, or its JSON string); ``outcome`` is one of :data:`OUTCOMES`,
    ``reason`` None for "stop"."""
    spec = check_structured({"type": "json", "schema": schema if isinstance(schema, (dict, str)) else json.dumps(schema)})
    grammar = service.request(spec)
    service.wait(grammar, timeout_s)
    if grammar.error is not None:
        return "compile", grammar.error
    matcher = grammar.matcher
    for index, token in enumerate(tokenizer.encode(text, add_bos=False)):
        if not matcher.accept_token(token):
            return "grammar", f"the grammar refuses token {index} of {text[:80]!r}"
    if not any(matcher.accept_token(t) for t in sorted(tokenizer.eos_token_ids)):
        return "grammar", f"the grammar does not end after {text[:80]!r}"
    violation = grammar.violation(text)
    return ("stop", None) if violation is None else ("validation", violation)
