"""A grammar-compile worker process (run as a script, so it imports only xgrammar).

Protocol, one JSON document per line: the parent writes ``{"tokenizer_info": ...,
"any_whitespace": ...}`` (xgrammar's serialised TokenizerInfo), the worker answers ``"ready"``
once its compiler exists; then for each ``{"type": ..., "schema": ...}`` it answers
``{"grammar": <serialised CompiledGrammar>}`` or ``{"error": <message>}``. It ends when its
input closes; the parent kills it when a compile runs past its deadline."""
from __future__ import annotations

import json
import os
import sys

LOOSE_STRING_CHAR, JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'


def json_schema_ebnf(schema: str, any_whitespace: bool) -> str:
    """xgrammar's EBNF for a strict JSON schema, with the string characters of length-bounded
    strings narrowed to what JSON allows: xgrammar 0.2.8 writes ``[^"\\\r\n]`` for them, which
    admits raw control characters (U+0000..U+001F) that ``json.loads`` rejects."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True))
    return ebnf.replace(LOOSE_STRING_CHAR, JSON_STRING_CHAR)


def compile_spec(compiler, spec: dict, any_whitespace: bool):
    """``spec`` (``check_structured``'s form) compiled by ``compiler`` (an xgrammar GrammarCompiler)."""
    kind, schema = spec["type"], spec["schema"]
    if kind == "json":
        if schema is None:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_grammar(json_schema_ebnf(schema, any_whitespace))
    if kind == "regex":
        return compiler.compile_regex(schema)
    return compiler.compile_grammar(schema)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # no sibling module shadows a package
    import xgrammar

    read, write = sys.stdin.buffer, sys.stdout.buffer
    header = json.loads(read.readline())
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(header["tokenizer_info"]),
                                        max_threads=1)
    write.write(b'"ready"\n')
    write.flush()
    for line in read:
        try:
            reply = {"grammar": compile_spec(compiler, json.loads(line), header["any_whitespace"]).serialize_json()}
        except Exception as error:  # every failure goes back to the request that asked
            reply = {"error": str(error)}
        write.write(json.dumps(reply).encode() + b"\n")
        write.flush()


if __name__ == "__main__":
    main()
