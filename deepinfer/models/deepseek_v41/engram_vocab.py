"""Engram's compressed vocabulary: tokens whose text normalises to the same string share one id.

Each id of a ``tokenizer.json`` is decoded alone (special tokens kept) and normalised: NFKC,
then NFD, accents stripped, lowercased, every run of spaces, tabs and newlines made one space,
and the result stripped of spaces at both ends unless it is a single space. A token whose text is
not valid UTF-8 on its own (it decodes with U+FFFD) keeps its vocabulary spelling instead, so
byte pieces never merge. Compressed ids are numbered in order of first appearance."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

REPLACEMENT_CHAR = "\ufffd"
_LONE_SPACE = "\ue000"  # a private-use stand-in that keeps a single-space text from being stripped


@dataclass(frozen=True)
class CompressedVocab:
    """``ids[t]``: the compressed id of token ``t``; ``size``: how many compressed ids there are;
    ``tokenizer_json``: the ``tokenizer.json`` text the map comes from, which a checkpoint of
    the model must carry (None for :meth:`identity`)."""

    ids: tuple[int, ...]
    size: int
    tokenizer_json: str | None = None

    @classmethod
    def identity(cls, vocab_size: int) -> "CompressedVocab":
        """Every token its own compressed id: the vocabulary of a model without a tokenizer file
        (random weights, served by the byte tokenizer)."""
        return cls(tuple(range(vocab_size)), vocab_size)

    @classmethod
    def from_tokenizer_json(cls, text: str) -> "CompressedVocab":
        """The compressed vocabulary of a ``tokenizer.json`` given as text (computed once per text)."""
        return _compress(text)

    @classmethod
    def from_tokenizer_file(cls, path: str | Path) -> "CompressedVocab":
        """The compressed vocabulary of a ``tokenizer.json`` file."""
        return cls.from_tokenizer_json(Path(path).read_text(encoding="utf-8"))

    def check_covers(self, vocab_size: int, source: str) -> None:
        """Raise ValueError unless every token id of a model of ``vocab_size`` has a compressed id."""
        if len(self.ids) < vocab_size:
            raise ValueError(f"{source} has {len(self.ids)} token ids, fewer than the model's vocab_size "
                             f"{vocab_size}: Engram hashes every token through the tokenizer's compressed "
                             f"vocabulary; use the checkpoint's own tokenizer")


def normalizer():
    """The ``tokenizers`` normaliser that gives each token's compressed key (module docstring)."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(), normalizers.Replace(_LONE_SPACE, " "),
    ])


@functools.lru_cache(maxsize=4)
def _compress(text: str) -> CompressedVocab:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_str(text)
    normalize = normalizer().normalize_str
    keys: dict[str, int] = {}
    ids = []
    for token in range(tokenizer.get_vocab_size()):
        piece = tokenizer.decode([token], skip_special_tokens=False)
        if REPLACEMENT_CHAR in piece:
            key = tokenizer.id_to_token(token)
            key = piece if key is None else key
        else:
            key = normalize(piece) or piece
        ids.append(keys.setdefault(key, len(keys)))
    return CompressedVocab(tuple(ids), len(keys), text)
