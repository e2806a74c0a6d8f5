"""A grammar-compile worker process (run as a script, so it imports only the grammar libraries).

Protocol, one JSON document per line: the parent writes a header, ``{"any_whitespace": ...,
"xgrammar_info": <xgrammar's serialised TokenizerInfo> | None, "tokens": [hex bytes per id] |
None, "stop_ids": [...]}``; the worker answers ``"ready"`` once its compilers exist. Then for
each ``{"type": ..., "candidates": [{"backend": "llguidance" | "xgrammar", "schema": ...}, ...]}``
it compiles the first candidate its backend accepts and answers ``{"backend": ..., "grammar":
..., "warnings": [...]}`` (xgrammar: a serialised CompiledGrammar; llguidance: its grammar
document, checked against the vocabulary) or ``{"error": <the first candidate's message>}``.
It ends when its input closes; the parent kills it when a compile runs past its deadline."""
from __future__ import annotations

import json
import os
import sys
import time

LOOSE_STRING_CHAR, JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'
PROBE_TOKENS = 8
"""Tokens an llguidance grammar is walked for after it compiles (see :meth:`Compilers._probe`)."""
MAX_MASK_S = 0.1
"""The longest one llguidance token mask may take in that walk: every engine step waits for it."""
ANY_JSON_SCHEMA = {"type": ["object", "array"]}
"""What "any JSON" (no schema) means under llguidance, as under xgrammar's built-in grammar."""


def json_schema_ebnf(schema: str, any_whitespace: bool) -> str:
    """xgrammar's EBNF for a strict JSON schema, with the string characters of length-bounded
    strings narrowed to what JSON allows: xgrammar 0.2.8 writes ``[^"\\\r\n]`` for them, which
    admits raw control characters (U+0000..U+001F) that ``json.loads`` rejects."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True))
    return ebnf.replace(LOOSE_STRING_CHAR, JSON_STRING_CHAR)


def llguidance_options(any_whitespace: bool) -> dict:
    """llguidance's JSON options: keywords it does not implement are left to validation
    (``lenient``), ``oneOf`` is read as ``anyOf`` (validation checks exclusivity), and without
    ``any_whitespace`` the separators are xgrammar's (``", "`` and ``": "``)."""
    options = {"lenient": True, "coerce_one_of": True, "whitespace_flexible": any_whitespace}
    if not any_whitespace:
        options.update(item_separator=", ", key_separator=": ")
    return options


def llguidance_tokenizer(tokens: list[bytes], stop_ids: list[int]):
    """llguidance's view of a vocabulary: ``tokens[i]`` the bytes id ``i`` writes, ``b""`` for ids
    never allowed inside a grammar (they become special tokens); ``stop_ids`` end a grammar."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    class _Vocabulary:
        eos_token_id, bos_token_id = stop_ids[0], None

        def __init__(self):
            self.tokens = [piece or b"\xff[control %d]" % i for i, piece in enumerate(tokens)]
            self.special_token_ids = [i for i, piece in enumerate(tokens) if not piece]
            self._byte_ids = {piece[0]: i for i, piece in enumerate(tokens) if len(piece) == 1}

        def __call__(self, text):
            data = text if isinstance(text, bytes) else text.encode()
            return [self._byte_ids[b] for b in data if b in self._byte_ids]

    return llguidance.LLTokenizer(TokenizerWrapper(_Vocabulary()), n_vocab=len(tokens), eos_token=list(stop_ids))


class Compilers:
    """The compilers one worker holds (built from the header): xgrammar's, llguidance's, or both."""

    def __init__(self, header: dict):
        self.any_whitespace = header["any_whitespace"]
        self.xgrammar = self.llguidance = None
        if header.get("xgrammar_info") is not None:
            import xgrammar

            info = xgrammar.TokenizerInfo.deserialize_json(header["xgrammar_info"])
            self.xgrammar = xgrammar.GrammarCompiler(info, max_threads=1)
        if header.get("tokens") is not None:
            self.llguidance = llguidance_tokenizer([bytes.fromhex(t) for t in header["tokens"]], header["stop_ids"])

    def compile(self, spec: dict) -> dict:
        """The reply to ``spec``: the first candidate that compiles, else the first one's error."""
        candidates = spec.get("candidates") or [{"backend": "xgrammar", "schema": spec.get("schema")}]
        first_error = None
        for candidate in candidates:
            try:
                if candidate["backend"] == "llguidance":
                    grammar, warnings = self._llguidance(spec["type"], candidate["schema"])
                else:
                    grammar, warnings = self._xgrammar(spec["type"], candidate["schema"]), []
                return {"backend": candidate["backend"], "grammar": grammar, "warnings": warnings}
            except Exception as error:  # every failure goes back to the request that asked
                first_error = first_error or str(error)
        return {"error": first_error}

    def _xgrammar(self, kind: str, schema: str | None) -> str:
        if kind == "json":
            compiled = (self.xgrammar.compile_builtin_json_grammar() if schema is None else
                        self.xgrammar.compile_grammar(json_schema_ebnf(schema, self.any_whitespace)))
        elif kind == "regex":
            compiled = self.xgrammar.compile_regex(schema)
        else:
            compiled = self.xgrammar.compile_grammar(schema)
        return compiled.serialize_json()

    def _llguidance(self, kind: str, schema: str | None) -> tuple[str, list[str]]:
        from llguidance import LLMatcher

        if kind == "json":
            try:
                document = ANY_JSON_SCHEMA if schema is None else json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not JSON: {error}") from None
            if document is True:
                document = {}
            elif document is False:
                raise ValueError("the schema is false: no JSON value is valid under it")
            elif not isinstance(document, dict):
                raise ValueError(f"a JSON schema is an object or a boolean, not {schema}")
            grammar = LLMatcher.grammar_from_json_schema(document, defaults=llguidance_options(self.any_whitespace))
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(schema)
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(schema))
        matcher = LLMatcher(self.llguidance, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        warnings = matcher.get_grammar_warnings()
        self._probe(matcher)
        return grammar, warnings

    def _probe(self, matcher) -> None:
        """Walk the grammar for :data:`PROBE_TOKENS` tokens (each time the lowest allowed id that is
        not a stop token), so a grammar that hits llguidance's parser limits, or whose masks take
        longer than :data:`MAX_MASK_S`, is refused here rather than midway through a request."""
        stops = set(self.llguidance.eos_tokens)
        for _ in range(PROBE_TOKENS):
            started = time.monotonic()
            mask = matcher.compute_bitmask()
            took = time.monotonic() - started
            if took > MAX_MASK_S:
                raise ValueError(f"llguidance takes {took:.2f} s to compute one token mask of this grammar (at most "
                                 f"{MAX_MASK_S:g} s); engine.structured.backend=xgrammar may suit it")
            token = next((i for i in _allowed(mask) if i not in stops), None)
            if token is None or not matcher.consume_token(token):
                break
        if matcher.is_error():
            raise ValueError(f"llguidance: {matcher.get_error().splitlines()[0]}")


def _allowed(mask: bytes):
    """The ids a little-endian bitmask allows, in order."""
    for index, byte in enumerate(mask):
        for bit in range(8):
            if byte >> bit & 1:
                yield index * 8 + bit


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # no sibling module shadows a package
    read, write = sys.stdin.buffer, sys.stdout.buffer
    compilers = Compilers(json.loads(read.readline()))
    write.write(b'"ready"\n')
    write.flush()
    for line in read:
        write.write(json.dumps(compilers.compile(json.loads(line))).encode() + b"\n")
        write.flush()


if __name__ == "__main__":
    main()
