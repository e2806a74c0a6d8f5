"""A checkpoint with every V4.1 feature on (Engram, cross-layer sharing, candidate-block top-k):
our writer's layout, and write -> load -> identical logits."""
import json

import pytest
import tokenizers
import torch
from safetensors import safe_open
from tokenizers import models

from deepinfer.hal import OpTable
from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
from deepinfer.models.deepseek_v41.loader import LoaderError
from deepinfer.models.deepseek_v41.weights import load_pretrained, save_pretrained
from tests.models.test_candidate_top_k import CANDIDATES
from tests.models.test_cross_layer_sharing import SHARING
from tests.models.tiny_model import ENGRAM, SequenceRunner, tiny_engram_model

FEATURES = {**SHARING, **CANDIDATES, **ENGRAM, "engram_layer_ids": [1, 5], "engram_compressed_vocab_size": 400}
"""Layer 5 reads layer 4's KV and index keys and selects inside layer 4's candidate blocks; Engram
reads at a producer (1) and a consumer (5)."""


def _tokenizer_json() -> str:
    """512 words; the last 112 are capitalised spellings of the first ones (400 compressed ids)."""
    words = [f"w{i}" for i in range(400)] + [f"W{i}" for i in range(112)]
    return tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")).to_str()


@pytest.fixture(scope="module")
def model():
    vocab = CompressedVocab.from_tokenizer_json(_tokenizer_json())
    assert vocab.size == 400 and vocab.ids[400] == vocab.ids[0]
    return tiny_engram_model(seed=5, vocab=vocab, batch_invariant=False, **FEATURES)


@pytest.fixture(scope="module")
def written(model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("every_feature")
    save_pretrained(model, directory)
    return directory


def _logits(model) -> torch.Tensor:
    """A prefill, a second chunk and two decode steps, every row's logits."""
    runner, seq = SequenceRunner(model, 1, 64), list(range(3, 50))
    rows = [runner.step({0: seq[:30]}, all_logits=True), runner.step({0: seq[30:45]}, all_logits=True)]
    rows += [runner.step({0: [token]}, decode=True) for token in seq[45:]]
    return torch.cat(rows)


def test_the_writer_stores_engram_in_the_official_layout(model, written):
    index = json.loads((written / "model.safetensors.index.json").read_text())["weight_map"]
    rows = model.layers[1].engram.embed.weight.shape[0]
    with safe_open(str(written / index["layers.1.engram.embed.weight"]), framework="pt") as shard:
        table, scale = shard.get_slice("layers.1.engram.embed.weight"), shard.get_slice("layers.1.engram.embed.scale")
        assert (table.get_dtype(), table.get_shape()) == ("F8_E4M3", [rows, 32])
        assert (scale.get_dtype(), scale.get_shape()) == ("F8_E8M0", [rows, 1])
        assert shard.get_slice("layers.5.engram.q_weight").get_dtype() == "BF16"
        assert shard.get_slice("layers.5.engram.wkv.weight").get_shape() == [5 * 64, 4 * 32]
    assert {"layers.5.engram.wkv.scale", "layers.1.engram.k_weight"} <= set(index)
    assert not any(name.startswith(("layers.0.engram", "mtp.0.engram")) for name in index)
    assert (written / "tokenizer.json").read_text(encoding="utf-8") == model.engram_vocab.tokenizer_json


@pytest.mark.parametrize("weight_format", [None, "mxfp4"])
def test_write_then_load_gives_identical_logits(model, written, weight_format):
    loaded = load_pretrained(written, OpTable("reference"), max_model_len=model.max_model_len,
                             weight_format=weight_format)
    assert loaded.cfg == model.cfg and loaded.engram_vocab.ids == model.engram_vocab.ids
    assert torch.equal(_logits(loaded), _logits(model))


def test_a_checkpoint_without_its_tokenizer_or_with_other_engram_tensors_is_refused(written, tmp_path):
    for name in ("config.json", "model.safetensors.index.json"):
        (tmp_path / name).write_text((written / name).read_text())
    for shard in written.glob("*.safetensors"):
        (tmp_path / shard.name).symlink_to(shard)
    with pytest.raises(LoaderError, match=r"has no tokenizer.json, and its Engram layers \[1, 5\]"):
        load_pretrained(tmp_path, OpTable("reference"), max_model_len=256)
    (tmp_path / "tokenizer.json").write_text((written / "tokenizer.json").read_text())
    config = json.loads((written / "config.json").read_text())
    for layers, message in (([1], r"unknown tensor 'layers.5.engram"), ([1, 5, 6], r"'layers.6.engram.* is absent")):
        config["text_config"]["engram_layer_ids"] = layers
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(LoaderError, match=message):
            load_pretrained(tmp_path, OpTable("reference"), max_model_len=256)


def test_a_model_without_a_tokenizer_cannot_be_written(tmp_path):
    with pytest.raises(ValueError, match=r"identity vocabulary of a model without a tokenizer"):
        save_pretrained(tiny_engram_model(), tmp_path)
