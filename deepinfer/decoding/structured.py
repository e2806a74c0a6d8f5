"""Structured outputs: JSON schema, regex and EBNF grammars through xgrammar or llguidance.

The request's ``structured`` value is checked here (:func:`check_structured`), grammars compile
in :class:`~deepinfer.decoding.grammar_service.GrammarService`, and a finished JSON output is
validated against its schema (:mod:`deepinfer.decoding.schema_check`). Each step, :func:`step_bitmasks` fills the
allowed-token masks of every constrained request: its next row, then, for each DSpark draft the
grammar accepts, the row after it (the probed drafts are rolled back). A draft the grammar
rejects has probability 0 in its row's masked distribution, so verification rejects it.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from deepinfer.hal.ops.token_bitmask import bitmask_words
from deepinfer.tokenizer import ByteTokenizer, Tokenizer, TokenizerBase

STRUCTURED_TYPES = ("json", "regex", "ebnf")
EXTRA = "structured"
TEXT_MARKERS = ("<think>", "</think>")
"""Added tokens that stay writable text inside a grammar; so does every token holding "DSML"."""


def check_structured(value: Any) -> dict | None:
    """The validated form of ``SamplingParams.structured``: ``{"type": ..., "schema": ...}``.

    ``json``: ``schema`` a JSON schema as a dict or a string, or absent / None for any JSON; a
    dict is serialised in its own key order, so properties are generated in the order the schema
    lists them, the same for a dict and for its ``json.dumps`` string. ``regex`` and ``ebnf``:
    ``schema`` a non-empty string (EBNF in xgrammar's GBNF dialect, with a ``root`` rule). The
    grammar itself is checked when it compiles, per request."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in STRUCTURED_TYPES:
        raise ValueError(f"structured must be a dict with 'type' one of {list(STRUCTURED_TYPES)} and a 'schema'; "
                         f"got {value!r}")
    unknown = sorted(set(value) - {"type", "schema"})
    if unknown:
        raise ValueError(f"structured has unknown keys {unknown}; it takes 'type' and 'schema'")
    kind, schema = value["type"], value.get("schema")
    if kind == "json":
        if not (schema is None or isinstance(schema, (dict, str))):
            raise ValueError(f"structured JSON schema must be a dict, a JSON string, or None for any JSON; "
                             f"got {type(schema).__name__}")
        if isinstance(schema, dict):
            try:
                schema = json.dumps(schema)
            except (TypeError, ValueError) as err:
                raise ValueError(f"structured JSON schema is not JSON-serialisable: {err}") from err
    elif not isinstance(schema, str) or not schema:
        raise ValueError(f"structured {kind} needs 'schema' as a non-empty string; got {schema!r}")
    return {"type": kind, "schema": schema}


def raw_token_bytes(tokenizer: TokenizerBase, vocab_size: int) -> list[bytes]:
    """The bytes each id ``0..vocab_size-1`` writes, with ``b""`` for ids that must never appear
    inside a grammar: control tokens (BOS, EOS, PAD, role and tool markers, every added token
    except :data:`TEXT_MARKERS` and the DSML markers) and ids outside the tokenizer."""
    out = [b""] * vocab_size
    if isinstance(tokenizer, ByteTokenizer):
        for byte in range(256):
            if byte + 3 < vocab_size:
                out[byte + 3] = bytes([byte])
    elif isinstance(tokenizer, Tokenizer):
        spec = json.loads(tokenizer.backend.to_str())
        decoder = (spec.get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            raise ValueError(f"structured outputs support byte-level BPE tokenizers (and the byte tokenizer); this "
                             f"tokenizer.json's decoder is {decoder!r}")
        alphabet, added = _byte_level_alphabet(), {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
        for piece, token in spec["model"]["vocab"].items():
            if token < vocab_size and token not in added:
                out[token] = bytes(alphabet[c] for c in piece)
        for token, text in added.items():
            if token < vocab_size:
                out[token] = text.encode() if text in TEXT_MARKERS or "DSML" in text else b""
    else:
        raise ValueError(f"structured outputs need a Tokenizer or ByteTokenizer, got {type(tokenizer).__name__}")
    for token in tokenizer.special_token_ids:
        if token < vocab_size:
            out[token] = b""
    return out


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins: char -> byte (bytes that print as themselves keep
    their code point; the rest take 256, 257, ... in byte order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for byte in range(256):
        if byte not in chars:
            chars[byte], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


def step_bitmasks(chunks, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Masks for the constrained rows of a step: ``(bitmask int32 [M, ceil(V/32)], rows int64 [M])``
    over the logits rows of ``chunks`` (one per verified draft plus the final row, in order), or
    None when no request is constrained. Matchers end where they started."""
    constrained = [c for c in chunks if c.request.grammar is not None]
    if not constrained:
        return None
    bitmask = torch.full((sum(len(c.drafts) + 1 for c in constrained), bitmask_words(vocab_size)), -1,
                         dtype=torch.int32)
    rows, row = [], 0
    for chunk in chunks:
        matcher = chunk.request.grammar.matcher if chunk.request.grammar is not None else None
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, len(rows))
            rows.append(row)
            probed = 0
            for j, draft in enumerate(chunk.drafts):
                if not matcher.accept_token(draft):
                    break
                probed += 1
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, len(rows))
                rows.append(row + j + 1)
            if probed:
                matcher.rollback(probed)
        row += len(chunk.drafts) + 1
    return bitmask[:len(rows)], torch.tensor(rows, dtype=torch.int64)
