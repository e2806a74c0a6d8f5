"""Grammar compilation for one engine, per request: the backend, the compile, the matcher.

A request waits for its matcher without holding up the others; a grammar that fails to compile,
or does not compile within the timeout of its own compile, fails that request alone
(:mod:`deepinfer.decoding.grammar_pool`)."""
from __future__ import annotations

import importlib.util
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deepinfer.decoding.grammar_llguidance import LLGuidanceMatcher, ascii_classes, llguidance_schema
from deepinfer.decoding.grammar_pool import CompilePool, CompileTimeout, GrammarCompileError
from deepinfer.decoding.grammar_worker import llguidance_tokenizer
from deepinfer.decoding.schema_check import BACKENDS as SCHEMA_BACKENDS
from deepinfer.decoding.schema_check import json_violation, read_json_schema, validation_only_keywords
from deepinfer.decoding.schema_rewrite import enforced_by_rewrite, grammar_schema
from deepinfer.decoding.structured import EXTRA, raw_token_bytes
from deepinfer.tokenizer import TokenizerBase

GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance")
CACHE_ENTRIES = 4096
"""Compiled grammars kept per engine (the oldest finished one goes first)."""
_KNOWN_WARNINGS = ("Unimplemented keys", "oneOf not fully supported")
"""llguidance warnings :func:`~deepinfer.decoding.schema_check.validation_only_keywords` already
lists with paths; others join the request's validation-only list as written."""
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass
class RequestGrammar:
    """One request's grammar: the compile future until it is ready, then its matcher and the
    ``backend`` that compiled it, and for JSON the validator of the finished output (or why the
    schema itself is invalid) and the schema's keywords that only that validation enforces
    (``"keyword at #/path"``, per candidate backend until one compiled)."""

    spec: dict
    future: Future
    key: tuple = ()
    matcher: Any = None
    backend: str | None = None
    error: str | None = None
    validator: Any = None
    invalid_schema: str | None = None
    validation_only: list[str] = field(default_factory=list)
    validation_only_by_backend: dict = field(default_factory=dict)

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
    that request fails), a cache keyed by grammar, and matchers that roll back without limit.

    ``backend`` (:data:`GRAMMAR_BACKENDS`) compiles the grammars: ``xgrammar``, ``llguidance``,
    or ``auto``, which gives a JSON schema to the backend that leaves fewer of its keywords to
    validation (llguidance on a tie), the other one if that one refuses it, and regex and EBNF
    (xgrammar's GBNF dialect) to xgrammar. JSON schemas are strict (no properties beyond those
    listed, no items past a tuple) and keep their property order; ``any_whitespace`` False fixes
    their separators to ``", "`` and ``": "``; any JSON (no schema) is an object or an array."""

    def __init__(self, tokenizer: TokenizerBase, vocab_size: int, timeout_s: float, workers: int,
                 any_whitespace: bool = False, backend: str = "auto"):
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"unknown grammar backend {backend!r}; expected one of {list(GRAMMAR_BACKENDS)}")
        needed = ["jsonschema", *(("xgrammar", "llguidance") if backend == "auto" else (backend,))]
        for package in needed:
            if importlib.util.find_spec(package) is None:
                raise ImportError(f"structured outputs use {package}, which is not installed; install it with: "
                                  f"pip install 'deepinfer[{EXTRA}]'")
        self.vocab_size, self.timeout_s, self.backend = vocab_size, timeout_s, backend
        self._any_whitespace = any_whitespace
        self._stop_ids = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
        self._info: Future = Future()
        threading.Thread(target=self._build_info, args=(tokenizer,), name="deepinfer-grammar-info",
                         daemon=True).start()
        self._pool = CompilePool(self._header, workers, timeout_s)
        self._preparer = ThreadPoolExecutor(workers, thread_name_prefix="deepinfer-grammar-read")
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-grammar-build")
        self._lock = threading.Lock()
        self._cache: dict[tuple, Future] = {}
        self._compiled: dict[tuple, Future] = {}

    def _build_info(self, tokenizer: TokenizerBase) -> None:
        """Each backend's view of the vocabulary (importing xgrammar takes seconds: off the engine's thread)."""
        try:
            tokens = raw_token_bytes(tokenizer, self.vocab_size)
            info = {"tokens": tokens, "xgrammar": None, "llguidance": None}
            if self.backend in ("xgrammar", "auto"):
                import xgrammar

                info["xgrammar"] = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_ids)
            if self.backend in ("llguidance", "auto"):
                info["llguidance"] = llguidance_tokenizer(tokens, self._stop_ids)
            self._info.set_result(info)
        except BaseException as error:  # every compile then fails with it
            self._info.set_exception(error)

    def _header(self) -> dict:
        info = self._info.result()
        return {"any_whitespace": self._any_whitespace, "stop_ids": self._stop_ids,
                "xgrammar_info": info["xgrammar"].serialize_json() if info["xgrammar"] is not None else None,
                "tokens": [t.hex() for t in info["tokens"]] if info["llguidance"] is not None else None}

    def request(self, spec: dict) -> RequestGrammar:
        """Start (or reuse) the compilation of ``spec`` (from :func:`check_structured`). Reading
        the schema (its validator, rewrite and keywords) happens off the engine's thread too. A
        JSON schema that breaks its own metaschema fails the request once it has compiled (a
        compile error, more specific, goes first)."""
        key = (spec["type"], spec["schema"])
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if len(self._cache) >= CACHE_ENTRIES:
                    oldest = next((k for k, f in self._cache.items() if f.done()), None)
                    self._cache.pop(oldest, None)
                    self._compiled.pop(oldest, None)
                future = self._cache[key] = Future()
                self._preparer.submit(self._prepare, spec, future)
        return RequestGrammar(spec, future, key=key)

    def _prepare(self, spec: dict, future: Future) -> None:
        """Read ``spec``, send its compile to the pool, and settle ``future`` with both."""
        try:
            prepared = {"validator": None, "invalid": None, "by_backend": {}}
            if spec["type"] == "json":
                try:
                    schema, prepared["validator"] = read_json_schema(spec["schema"])
                    spec = {**spec, "schema": schema}
                    enforced = enforced_by_rewrite(spec["schema"])
                    prepared["by_backend"] = {
                        b: [k for k in validation_only_keywords(spec["schema"], b) if k not in enforced]
                        for b in SCHEMA_BACKENDS}
                except ValueError as error:
                    prepared["invalid"] = f"structured output: invalid json grammar: {error}"
            candidates = _candidates(self.backend, spec["type"], prepared["by_backend"])
            compiled = self._pool.submit(_compile_request(spec, candidates))
        except BaseException as error:  # the request fails with it, the others go on
            future.set_exception(error)
            return

        def settle(done: Future) -> None:
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result({**prepared, "reply": done.result()})

        compiled.add_done_callback(settle)

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
        else:
            prepared = grammar.future.result()
            grammar.validator, grammar.invalid_schema = prepared["validator"], prepared["invalid"]
            grammar.validation_only_by_backend = prepared["by_backend"]
            if grammar.invalid_schema is None:
                return self._attach_matcher(grammar)
            grammar.error = grammar.invalid_schema
        return True

    def wait(self, grammar: RequestGrammar, timeout_s: float = 600.0) -> None:
        """Block until ``grammar`` is settled (:meth:`poll`); for scripts and tests, not the engine."""
        deadline = time.monotonic() + timeout_s
        while not self.poll(grammar):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the grammar did not settle within {timeout_s:g} s")
            time.sleep(0.001)

    def _attach_matcher(self, grammar: RequestGrammar) -> bool:
        """Give ``grammar`` its matcher once the compiled grammar is loaded (off the engine's thread)."""
        reply = grammar.future.result()["reply"]
        with self._lock:
            loaded = self._compiled.get(grammar.key)
            if loaded is None:
                loaded = self._compiled[grammar.key] = self._builder.submit(self._load, reply)
        if not loaded.done():
            return False
        if loaded.exception() is not None:
            kind = grammar.spec["type"]
            grammar.error = f"structured output: the {kind} grammar could not be loaded: {loaded.exception()}"
            return True
        grammar.backend = reply["backend"]
        if grammar.backend == "llguidance":
            grammar.matcher = LLGuidanceMatcher(loaded.result().deep_copy(), self._stop_ids)
        else:
            import xgrammar

            grammar.matcher = xgrammar.GrammarMatcher(loaded.result())
        if grammar.spec["type"] == "json":
            extra = [w for w in reply.get("warnings", []) if not w.startswith(_KNOWN_WARNINGS)]
            grammar.validation_only = [*grammar.validation_only_by_backend.get(grammar.backend, []), *extra]
        return True

    def _load(self, reply: dict):
        info = self._info.result()
        if reply["backend"] == "llguidance":
            from llguidance import LLMatcher

            return LLMatcher(info["llguidance"], reply["grammar"], log_level=0)
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(reply["grammar"], info["xgrammar"])

    def shutdown(self) -> None:
        """Stop compiling: queued compiles are cancelled and the workers killed."""
        self._pool.shutdown()
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._builder.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for future in self._cache.values():
                future.cancel()


def _candidates(backend: str, kind: str, by_backend: dict) -> tuple[str, ...]:
    """The backends to try for a grammar, in order (see :class:`GrammarService`)."""
    if backend != "auto":
        return (backend,)
    if kind != "json":
        return ("xgrammar",)
    if by_backend and len(by_backend["llguidance"]) > len(by_backend["xgrammar"]):
        return ("xgrammar", "llguidance")
    return ("llguidance", "xgrammar")


def _compile_request(spec: dict, candidates: tuple[str, ...]) -> dict:
    """The worker's job for ``spec``: per candidate backend, the schema it compiles. A JSON
    schema is rewritten into the equivalent the grammar enforces best
    (:func:`~deepinfer.decoding.schema_rewrite.grammar_schema`), and for llguidance made strict
    (:func:`~deepinfer.decoding.grammar_llguidance.llguidance_schema`); a schema that is not JSON
    goes as written, for the compiler to name the error. A regex for llguidance says ASCII
    classes (:func:`~deepinfer.decoding.grammar_llguidance.ascii_classes`)."""
    schemas = dict.fromkeys(candidates, spec["schema"])
    if spec["type"] == "regex" and "llguidance" in schemas:
        schemas["llguidance"] = ascii_classes(spec["schema"])
    if spec["type"] == "json" and spec["schema"] is not None:
        try:
            rewritten = grammar_schema(spec["schema"])
            schemas = {b: llguidance_schema(rewritten) if b == "llguidance" else rewritten for b in candidates}
        except ValueError:
            pass
    return {"type": spec["type"], "candidates": [{"backend": b, "schema": schemas[b]} for b in candidates]}


def _clean(error: BaseException) -> str:
    """xgrammar's message without its timestamp, source location and check expression."""
    text = str(error).strip()
    return _XGRAMMAR_PREFIX.sub("", text).strip() or type(error).__name__
