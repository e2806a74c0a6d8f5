"""Grammar compiles in worker processes: each deadline counts from its own compile, a refused
grammar keeps its worker, a timed-out one loses it, and a cached grammar compiles once."""
import json

import pytest

xgrammar = pytest.importorskip("xgrammar")

from deepinfer.decoding.grammar_pool import CompilePool, CompileTimeout, GrammarCompileError  # noqa: E402
from deepinfer.decoding.grammar_service import GrammarService  # noqa: E402
from deepinfer.decoding.structured import raw_token_bytes  # noqa: E402
from deepinfer.tokenizer import ByteTokenizer  # noqa: E402
from tests.decoding.test_structured import _slow_schema  # noqa: E402

VOCAB = 300


@pytest.fixture()
def pool_and_info():
    info = xgrammar.TokenizerInfo(raw_token_bytes(ByteTokenizer(), VOCAB), xgrammar.VocabType.RAW,
                                  vocab_size=VOCAB, stop_token_ids=sorted(ByteTokenizer().eos_token_ids))
    header = lambda: {"xgrammar_info": info.serialize_json(), "any_whitespace": False}  # noqa: E731
    pool = CompilePool(header, workers=1, timeout_s=0.5)
    yield pool, info
    pool.shutdown()


def _matches(reply: dict, info, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(xgrammar.CompiledGrammar.deserialize_json(reply["grammar"], info))
    return all(matcher.accept_token(byte + 3) for byte in text.encode())


def test_time_queued_behind_a_slow_compile_does_not_count(pool_and_info):
    """One worker: the quick grammar waits behind the slow one (killed at 0.5 s, then the worker
    restarts) for longer than the timeout, and still compiles."""
    pool, info = pool_and_info
    slow = pool.submit({"type": "json", "schema": json.dumps(_slow_schema(0))})
    quick = pool.submit({"type": "regex", "schema": r"\d{3}"})
    with pytest.raises(CompileTimeout):
        slow.result(timeout=60)
    assert _matches(quick.result(timeout=60), info, "123")


def test_a_refused_grammar_fails_alone_and_keeps_its_worker(pool_and_info):
    pool, info = pool_and_info
    assert _matches(pool.submit({"type": "regex", "schema": "ab"}).result(timeout=60), info, "ab")
    (worker,) = pool._processes
    with pytest.raises(GrammarCompileError, match="parenthesis"):
        pool.submit({"type": "regex", "schema": "a(b"}).result(timeout=60)
    assert _matches(pool.submit({"type": "ebnf", "schema": 'root ::= "x" [0-9]'}).result(timeout=60), info, "x7")
    assert pool._processes == {worker} and worker.poll() is None


def test_a_grammar_is_compiled_once_per_engine():
    service = GrammarService(ByteTokenizer(), VOCAB, timeout_s=60, workers=1)
    try:
        spec = {"type": "regex", "schema": "[ab]+"}
        first, second = service.request(spec), service.request(dict(spec))
        assert first.future is second.future
        service.wait(first, 60)
        service.wait(second, 60)
        assert first.error is None
        assert first.matcher is not second.matcher and len(service._compiled) == 1
    finally:
        service.shutdown()


def test_a_schema_is_read_off_the_callers_thread(monkeypatch):
    """Building a schema's validator and rewrite takes seconds for megabyte schemas: the engine's
    thread only queues it."""
    import threading

    from deepinfer.decoding import schema_check

    readers = []
    real = schema_check.json_validator
    def recording(text):
        readers.append(threading.current_thread())
        return real(text)

    monkeypatch.setattr(schema_check, "json_validator", recording)
    service = GrammarService(ByteTokenizer(), VOCAB, timeout_s=60, workers=1)
    try:
        grammar = service.request({"type": "json", "schema": json.dumps({"type": "integer"})})
        service.wait(grammar, 60)
        assert grammar.error is None and grammar.validator is not None
        assert readers and all(thread is not threading.current_thread() for thread in readers)
    finally:
        service.shutdown()
