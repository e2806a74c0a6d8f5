import json

import pytest
import torch
from safetensors import safe_open

from deepinfer.hal import OpTable
from deepinfer.models.deepseek_v41.loader import LoaderError
from deepinfer.models.deepseek_v41.weights import expected_shapes, load_pretrained, official_state_dict, save_pretrained
from tests.models.tiny_model import SequenceRunner, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, directory, max_shard_bytes=256 * 1024)
    return directory


def _logits(model, tokens):
    return SequenceRunner(model, 1, len(tokens)).step({0: tokens}, all_logits=True)


def test_names_follow_the_official_layout(model):
    names = set(official_state_dict(model))
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.0.hc_attn_fn", "layers.0.attn.attn_sink",
                 "layers.1.attn.compressor.wgate.weight", "layers.2.attn.indexer.weights_proj.weight",
                 "layers.3.ffn.experts.7.w2.weight", "layers.3.ffn.gate.bias", "layers.0.ffn.shared_experts.w1.weight",
                 "mtp.0.markov_head.embed.weight", "mtp.0.confidence_head.proj.weight", "mtp.0.main_proj.weight",
                 "mtp.0.hc_head_fn"):
        assert name in names, name
    assert "layers.2.attn.compressor.wgate.weight" not in names, "C1 layers have no gate"
    assert not any(n.startswith("layers.0.attn.indexer") for n in names), "SWA-only layers have no indexer"


def test_write_then_load_gives_identical_logits(model, saved):
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    loaded = load_pretrained(saved, OpTable("reference"), max_model_len=model.max_model_len)
    tokens = list(range(3, 40))
    assert torch.equal(_logits(model, tokens), _logits(loaded, tokens))


def test_checkpoint_stores_the_official_formats(saved):
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    expected = {"layers.0.attn.wq_a.weight": torch.float8_e4m3fn, "layers.0.attn.wq_a.scale": torch.float8_e8m0fnu,
                "layers.0.ffn.experts.0.w1.weight": torch.uint8, "layers.0.hc_attn_fn": torch.float32,
                "embed.weight": torch.bfloat16}
    for name, dtype in expected.items():
        with safe_open(saved / index[name], "pt") as f:
            assert f.get_tensor(name).dtype == dtype, name


def test_a_corrupt_shard_is_named(model, saved, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    shard = broken / index["head.weight"]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(LoaderError, match=shard.name):
        load_pretrained(broken, OpTable("reference"))


def test_a_checkpoint_of_another_shape_is_refused(model, saved):
    shapes = expected_shapes(model)
    assert shapes["layers.0.attn.wq_a.weight"] == (model.cfg.q_lora_rank, model.cfg.hidden_size)
    with pytest.raises(LoaderError, match=r"safetensors: tensor .layers\.0\.attn\.\w+\.weight. has shape"):
        load_pretrained(saved, OpTable("reference"), overrides={"q_lora_rank": 16})


def test_non_shifted_hyper_connections_use_the_hc_head():
    model = tiny_model(seed=2, hc_shifted=False)
    assert "hc_head_fn" in official_state_dict(model)
    tokens = list(range(3, 30))
    full = _logits(model, tokens)
    runner = SequenceRunner(model, 1, len(tokens))
    steps = [runner.step({0: tokens[:10]}, all_logits=True)] + [runner.step({0: [t]}, decode=True) for t in tokens[10:]]
    assert torch.allclose(torch.cat(steps), full, atol=5e-4, rtol=5e-4)


def test_draft_blocks_are_part_of_the_checkpoint(model):
    names = official_state_dict(model)
    assert len(model.mtp) == model.cfg.num_nextn_predict_layers
    assert all(f"mtp.{i}.main_proj.weight" in names for i in range(len(model.mtp)))
