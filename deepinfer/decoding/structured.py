"""Structured outputs: JSON schema, regex and EBNF grammars through xgrammar.

Grammars compile in worker processes with a cache (:class:`GrammarService`); a request waits for
its matcher without holding up the others, and a grammar that fails to compile, or does not
compile within the timeout of its own compile, fails that request alone. A finished JSON output
is validated against its schema (:mod:`deepinfer.decoding.schema_check`). Each step, :func:`step_bitmasks` fills the
allowed-token masks of every constrained request: its next row, then, for each DSpark draft the
grammar accepts, the row after it (the probed drafts are rolled back). A draft the grammar
rejects has probability 0 in its row's masked distribution, so verification rejects it.
"""
from __future__ import annotations

import importlib.util
import json
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.decoding.grammar_pool import CompilePool, CompileTimeout, GrammarCompileError
from deepinfer.decoding.schema_check import json_validator, json_violation, validation_only_keywords
from deepinfer.decoding.schema_rewrite import grammar_schema
from deepinfer.hal.ops.token_bitmask import bitmask_words
from deepinfer.tokenizer import ByteTokenizer, Tokenizer, TokenizerBase

STRUCTURED_TYPES = ("json", "regex", "ebnf")
EXTRA = "structured"
TEXT_MARKERS = ("<think>", "</think>")
"""Added tokens that stay writable text inside a grammar; so does every token holding "DSML"."""
CACHE_ENTRIES = 4096
"""Compiled grammars kept per engine (the oldest finished one goes first)."""
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


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


@dataclass
class RequestGrammar:
    """One request's grammar: the compile future until it is ready, then its matcher, and for
    JSON the validator of the finished output (or why the schema itself is invalid) and the
    schema's keywords that only that validation enforces (``"keyword at #/path"``)."""

    spec: dict
    future: Future
    matcher: Any = None
    error: str | None = None
    validator: Any = None
    invalid_schema: str | None = None
    validation_only: list[str] = field(default_factory=list)

    def violation(self, text: str) -> str | None:
        """Why the output ``text`` of a request that stopped must not end "stop", or None: the
        grammar did not complete (a stop string or stop token cut it short), or, for JSON, the
        text does not parse or breaks its schema (:func:`~deepinfer.decoding.schema_check.json_violation`)."""
        if not self.matcher.is_terminated():
            return ("structured output: a stop string or stop token ended the request before its grammar "
                    "completed; the output is partial")
        if self.spec["type"] != "json":
            return None
        found = json_violation(text, self.validator)
        return None if found is None else f"structured output: {found}"


class GrammarService:
    """Grammar compilation for one engine: ``workers`` processes (:class:`CompilePool`), each
    compile with ``timeout_s`` from when a worker starts it (a worker past it is killed, and only
    that request fails), a cache keyed by grammar, and matchers (xgrammar's roll back without
    limit). JSON schemas are strict (no properties beyond those listed) and keep their property
    order; ``any_whitespace`` False fixes their separators; any JSON (no schema) is xgrammar's
    built-in JSON grammar (an object or array)."""

    def __init__(self, tokenizer: TokenizerBase, vocab_size: int, timeout_s: float, workers: int,
                 any_whitespace: bool = False):
        for package in ("xgrammar", "jsonschema"):
            if importlib.util.find_spec(package) is None:
                raise ImportError(f"structured outputs use {package}, which is not installed; install it with: "
                                  f"pip install 'deepinfer[{EXTRA}]'")
        self.vocab_size, self.timeout_s = vocab_size, timeout_s
        self._info: Future = Future()
        threading.Thread(target=self._build_info, args=(tokenizer,), name="deepinfer-grammar-info",
                         daemon=True).start()
        self._pool = CompilePool(lambda: self._info.result().serialize_json(), any_whitespace, workers, timeout_s)
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str | None], Future] = {}
        self._compiled: dict[tuple[str, str | None], Any] = {}

    def _build_info(self, tokenizer: TokenizerBase) -> None:
        """xgrammar's view of the vocabulary (importing xgrammar takes seconds: off the engine's thread)."""
        try:
            import xgrammar

            stop_ids = sorted(t for t in tokenizer.eos_token_ids if t < self.vocab_size)
            self._info.set_result(xgrammar.TokenizerInfo(raw_token_bytes(tokenizer, self.vocab_size),
                                                         xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                                         stop_token_ids=stop_ids))
        except BaseException as error:  # every compile then fails with it
            self._info.set_exception(error)

    def request(self, spec: dict) -> RequestGrammar:
        """Start (or reuse) the compilation of ``spec`` (from :func:`check_structured`). A JSON
        schema that breaks its own metaschema fails the request once it has compiled (a compile
        error, more specific, goes first)."""
        key = (spec["type"], spec["schema"])
        validator, invalid, validation_only = None, None, []
        if spec["type"] == "json":
            try:
                validator = json_validator(spec["schema"])
                validation_only = validation_only_keywords(spec["schema"])
            except ValueError as error:
                invalid = f"structured output: invalid json grammar: {error}"
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if len(self._cache) >= CACHE_ENTRIES:
                    oldest = next((k for k, f in self._cache.items() if f.done()), None)
                    self._cache.pop(oldest, None)
                    self._compiled.pop(oldest, None)
                future = self._cache[key] = self._pool.submit(_compiled_spec(spec))
        return RequestGrammar(spec, future, validator=validator, invalid_schema=invalid,
                              validation_only=validation_only)

    def poll(self, grammar: RequestGrammar) -> bool:
        """True once ``grammar`` is settled: its matcher is ready, or ``grammar.error`` says why not."""
        if grammar.matcher is not None or grammar.error is not None:
            return True
        if not grammar.future.done():
            return False
        kind = grammar.spec["type"]
        if grammar.future.cancelled():
            grammar.error = f"structured output: the engine shut down before the {kind} grammar compiled"
            return True
        error = grammar.future.exception()
        if isinstance(error, CompileTimeout):
            grammar.error = (f"structured output: the {kind} grammar did not compile within "
                             f"engine.structured.compile_timeout_s={self.timeout_s:g} s of compiling; simplify it "
                             f"or raise the timeout")
        elif isinstance(error, GrammarCompileError):
            grammar.error = f"structured output: invalid {kind} grammar: {_clean(error)}"
        elif error is not None:
            grammar.error = f"structured output: the {kind} grammar could not be compiled: {error}"
        elif grammar.invalid_schema is not None:
            grammar.error = grammar.invalid_schema
        else:
            import xgrammar

            key = (kind, grammar.spec["schema"])
            with self._lock:
                compiled = self._compiled.get(key)
                if compiled is None:
                    compiled = self._compiled[key] = xgrammar.CompiledGrammar.deserialize_json(
                        grammar.future.result(), self._info.result())
            grammar.matcher = xgrammar.GrammarMatcher(compiled)
        return True

    def shutdown(self) -> None:
        """Stop compiling: queued compiles are cancelled and the workers killed."""
        self._pool.shutdown()


def _compiled_spec(spec: dict) -> dict:
    """What the grammar compiles for ``spec``: a JSON schema rewritten into the equivalent the
    grammar enforces best (:func:`~deepinfer.decoding.schema_rewrite.grammar_schema`); a schema
    that is not JSON goes as written, for the compiler to name the error."""
    if spec["type"] != "json":
        return spec
    try:
        return {**spec, "schema": grammar_schema(spec["schema"])}
    except ValueError:
        return spec


def _clean(error: BaseException) -> str:
    """xgrammar's message without its timestamp, source location and check expression."""
    text = str(error).strip()
    return _XGRAMMAR_PREFIX.sub("", text).strip() or type(error).__name__


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
