"""Engram's compressed vocabulary: DeepInfer's normalisation and the many-to-one id map."""
import tokenizers
from tokenizers import decoders, models

from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab

SPELLINGS = ["<pad>", "Hello", "hello", " HELLO", "héllo", "  ", "\n\t", "ﬁ", "fi", "x  y", "x y", "Ab ", "ab", " "]


def _word_level(spellings) -> str:
    vocab = {spelling: i for i, spelling in enumerate(spellings)}
    return tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=spellings[0])).to_str()


def test_tokens_that_normalise_alike_share_an_id_numbered_by_first_appearance():
    vocab = CompressedVocab.from_tokenizer_json(_word_level(SPELLINGS))
    # NFKC folds the ligature, NFD + accent stripping folds é, whitespace runs collapse and ends are
    # stripped, but a text of whitespace alone stays one space
    assert vocab.ids == (0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 2)
    assert vocab.size == 6


def test_byte_pieces_that_are_not_utf8_alone_keep_their_spelling():
    # byte-level spellings: Ã and Ä are the bytes c3 and c4, lead bytes of two-byte characters
    vocab = {"<pad>": 0, "Ã": 1, "Ä": 2, "Hello": 3, "ĠHELLO": 4, "hÃ©llo": 5}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<pad>"))
    tokenizer.decoder = decoders.ByteLevel()
    compressed = CompressedVocab.from_tokenizer_json(tokenizer.to_str())
    assert compressed.ids == (0, 1, 2, 3, 3, 3) and compressed.size == 4


def test_a_file_gives_the_same_map_and_remembers_its_text(tmp_path):
    text = _word_level(SPELLINGS)
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    loaded = CompressedVocab.from_tokenizer_file(tmp_path / "tokenizer.json")
    assert loaded == CompressedVocab.from_tokenizer_json(text) and loaded.tokenizer_json == text
    assert CompressedVocab.identity(4) == CompressedVocab((0, 1, 2, 3), 4)
