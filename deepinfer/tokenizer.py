"""Text <-> token ids, streaming detokenization, and chat prompts.

Two tokenizers share one interface (:class:`TokenizerBase`):

* :class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` read from a checkpoint's
  ``tokenizer.json`` (the official V4/V4.1 one spans ids 0..129279: BOS 0, EOS 1, PAD 2);
* :class:`ByteTokenizer` serves models that have no ``tokenizer.json`` (random weights).

BOS, stop and pad ids come from the model config, not from the tokenizer file.
:class:`IncrementalDecoder` turns generated ids into text pieces without ever showing half a
UTF-8 character. :func:`render_chat` renders OpenAI-style chat messages for official V4/V4.1
checkpoints through the optional ``deepseek-recipe`` package.
"""
from __future__ import annotations

import abc
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT_CHAR = "\ufffd"
BYTE_OFFSET = 3
BYTE_VOCAB = BYTE_OFFSET + 256
CHAT_EXTRA = "chat"
# model_type -> (model name deepseek-recipe accepts in a request, its prompt encoding class)
CHAT_TEMPLATES = {"deepseek_v4": ("DeepSeek-V4-Pro", "DeepseekV4Encoding"),
                  "deepseek_v41": ("DeepSeek-V4.1-Flash", "DeepseekV41Encoding")}


class NoChatTemplateError(ValueError):
    """The model has no chat template: it takes plain prompts (text or token ids) only."""


class TokenizerBase(abc.ABC):
    """What the engine needs of a tokenizer: ids of text, text of ids, and the special ids.

    ``vocab_size`` is the tokenizer's id space (its largest id + 1); the model's embedding may
    be larger. ``eos_token_ids`` are the ids that end generation."""

    def __init__(self, vocab_size: int, bos_token_id: int, eos_token_ids: int | Iterable[int],
                 pad_token_id: int | None):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.pad_token_id = pad_token_id
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids is empty; generation needs at least one stop id (the config's eos_token_id)")

    @property
    def special_token_ids(self) -> frozenset[int]:
        """BOS, every stop id, and PAD."""
        return self.eos_token_ids | {self.bos_token_id} | ({self.pad_token_id} - {None})

    def encode(self, text: str, add_bos: bool) -> list[int]:
        """Token ids of ``text``, with the BOS id first when ``add_bos``."""
        ids = self._encode_text(text)
        return [self.bos_token_id, *ids] if add_bos else ids

    @abc.abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` alone (no BOS)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` special tokens contribute nothing."""

    def check_fits(self, model_vocab_size: int, source: str) -> None:
        """Raise ValueError unless every id this tokenizer yields is a row of the model's
        embedding (``source`` names the tokenizer in the message)."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"{source} has ids up to {self.vocab_size - 1} but the model's vocab_size is "
                f"{model_vocab_size}; use the tokenizer the checkpoint was trained with, or fix "
                f"vocab_size in its config.json")
        outside = sorted(i for i in self.special_token_ids if not 0 <= i < model_vocab_size)
        if outside:
            raise ValueError(f"special token ids {outside} (bos/eos/pad from the model config) are outside "
                             f"the model's vocabulary 0..{model_vocab_size - 1}")


class Tokenizer(TokenizerBase):
    """A ``tokenizers.Tokenizer`` (from a ``tokenizer.json``) with the model's special ids.

    ``encode`` never lets the file's post-processor add tokens (BOS is added by ``add_bos``
    alone); special-token spellings typed in the text still encode as those tokens, so untrusted
    chat text goes through :func:`render_chat` instead."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int, eos_token_ids: int | Iterable[int],
                 pad_token_id: int | None):
        id_space = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        super().__init__(id_space, bos_token_id, eos_token_ids, pad_token_id)
        self.backend = backend

    @classmethod
    def from_file(cls, path: str | Path, bos_token_id: int, eos_token_ids: int | Iterable[int],
                  pad_token_id: int | None) -> "Tokenizer":
        return cls(tokenizers.Tokenizer.from_file(str(path)), bos_token_id, eos_token_ids, pad_token_id)

    def _encode_text(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ``skip_special_tokens`` drops the tokens the file marks special
        (V4 marks BOS/EOS/PAD special, but not the chat markers such as ``<｜User｜>``)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


class ByteTokenizer(TokenizerBase):
    """UTF-8 bytes as tokens, for models without a ``tokenizer.json``: byte ``b`` is id
    ``b + 3``; ids 0, 1, 2 are BOS, EOS and PAD by default.

    ``decode`` ignores every id outside the byte range (specials, and the ids 259 and up a
    random-weights model may sample) and shows invalid UTF-8 as U+FFFD."""

    def __init__(self, bos_token_id: int = 0, eos_token_ids: int | Iterable[int] = 1, pad_token_id: int | None = 2):
        super().__init__(BYTE_VOCAB, bos_token_id, eos_token_ids, pad_token_id)
        clashing = sorted(i for i in self.special_token_ids if BYTE_OFFSET <= i < BYTE_VOCAB)
        if clashing:
            raise ValueError(f"special ids {clashing} are byte ids of the byte tokenizer "
                             f"({BYTE_OFFSET}..{BYTE_VOCAB - 1}); use ids below {BYTE_OFFSET} or from {BYTE_VOCAB} on")
        self.vocab_size = max(BYTE_VOCAB, max(self.special_token_ids) + 1)

    def _encode_text(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids among ``ids``; all other ids are ignored, whatever
        ``skip_special_tokens`` says (special ids have no text here)."""
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Streams the text of generated ids: ``push`` one id, get the text it completed.

    A piece never ends inside a character: when the window's text ends in U+FFFD (the bytes of
    a character split over byte-level tokens, not all here yet) it is held back until a later
    id completes it, or until :meth:`finish`. ``"".join(pushed pieces) + finish()`` equals
    ``tokenizer.decode(all ids)`` for byte-level and byte tokenizers (their decoders work
    byte by byte). Each step decodes only the ids since the start of the last emitted piece;
    that one piece of context keeps decoders that treat a leading space specially right."""

    def __init__(self, tokenizer: TokenizerBase, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoded window: the first id of the last emitted piece
        self._read = 0  # ids before this have had their text emitted

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the newly completed text (often "")."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text still held back (an incomplete character shows as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        seen = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(seen) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(seen):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def load_tokenizer(checkpoint_dir: str | Path | None, vocab_size: int, bos_id: int,
                   eos_id: int | Iterable[int], pad_id: int | None) -> TokenizerBase:
    """The tokenizer of a model: ``<checkpoint_dir>/tokenizer.json`` when present, else a
    :class:`ByteTokenizer`. ``vocab_size`` and the special ids come from the model config; the
    tokenizer's ids must fit the model's vocabulary (ValueError otherwise)."""
    path = Path(checkpoint_dir) / TOKENIZER_FILE if checkpoint_dir is not None else None
    if path is not None and path.is_file():
        tokenizer: TokenizerBase = Tokenizer.from_file(path, bos_id, eos_id, pad_id)
        source = str(path)
    else:
        tokenizer = ByteTokenizer(bos_id, eos_id, pad_id)
        where = f"{checkpoint_dir} has no {TOKENIZER_FILE}" if checkpoint_dir is not None else "no checkpoint"
        source = f"the byte tokenizer ({where})"
    tokenizer.check_fits(vocab_size, source)
    return tokenizer


def render_chat(messages: list[dict[str, Any]], model_type: str, tokenizer: TokenizerBase | None,
                *, thinking: bool = True) -> str | list[int]:
    """The prompt of a chat for an official V4 (``deepseek_v4``) or V4.1 (``deepseek_v41``)
    checkpoint, rendered by ``deepseek-recipe`` (install the ``chat`` extra).

    ``messages`` are OpenAI Chat Completions messages (``role``, ``content``, and
    ``reasoning_content``, ``tool_calls``, ``tool_call_id`` where they apply); ``thinking``
    selects thinking mode (the official default is on). With a :class:`Tokenizer` the result is
    token ids, BOS first, encoded by deepseek-recipe: special tokens appear only where the
    template puts them, and a special-token spelling typed in a message stays plain text. With
    ``tokenizer=None`` it is the rendered prompt text. Other models, and models served by the
    byte tokenizer or by a tokenizer without the template's special tokens, raise
    :class:`NoChatTemplateError`."""
    if model_type not in CHAT_TEMPLATES:
        raise NoChatTemplateError(f"model_type {model_type!r}: this model has no chat template; pass plain prompts "
                                  f"(chat rendering exists for official checkpoints: {sorted(CHAT_TEMPLATES)})")
    if isinstance(tokenizer, ByteTokenizer):
        raise NoChatTemplateError(f"this {model_type} model has no {TOKENIZER_FILE} (it uses the byte tokenizer), "
                                  "so it has no chat template; pass plain prompts")
    recipe = _import_recipe(model_type)
    try:
        request = recipe.ChatCompletionRequest({"model": CHAT_TEMPLATES[model_type][0], "messages": messages})
        conversation = request.convert(recipe.ConversionOptions(default_thinking_mode=thinking)).conversation
    except (recipe.ConversionError, ValueError) as err:
        raise ValueError(f"cannot render these chat messages for {model_type}: {err}") from err
    encoding = _chat_encoding(model_type, tokenizer)
    if tokenizer is None:
        return encoding.render_conversation(conversation).prompt
    try:
        return encoding.encode(conversation)
    except RuntimeError as err:
        raise NoChatTemplateError(
            f"the tokenizer lacks the {model_type} chat tokens ({err}): this is not an official {model_type} "
            f"{TOKENIZER_FILE}, so the model has no chat template; pass plain prompts") from err


def _import_recipe(model_type: str):
    try:
        import deepseek_recipe
    except ImportError as err:
        raise ImportError(f"chat prompts for {model_type} are rendered by the deepseek-recipe package, which is not "
                          f"installed; install it with: pip install 'deepinfer[{CHAT_EXTRA}]'") from err
    return deepseek_recipe


@functools.lru_cache(maxsize=4)
def _chat_encoding(model_type: str, tokenizer: Tokenizer | None):
    """deepseek-recipe's prompt encoding of ``model_type``, holding ``tokenizer`` (building the
    recipe's copy of a 129k-token vocabulary takes most of a second, so it is kept)."""
    recipe = _import_recipe(model_type)
    encoding = getattr(recipe, CHAT_TEMPLATES[model_type][1])()
    if tokenizer is None:
        return encoding
    return encoding.with_tokenizer(recipe.Tokenizer.from_str(tokenizer.backend.to_str()))
