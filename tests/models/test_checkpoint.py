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
                 "mtp.0.markov_head.embed.weight", "mtp.0.confidence_head.proj.weight", "mtp.0.main_proj.weight"):
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
    assert all(f"mtp.{i}.attn.wkv.weight" in names for i in range(len(model.mtp)))


@pytest.mark.parametrize("draft_hc_shifted", [None, False])
def test_draft_layers_follow_the_official_layout(draft_hc_shifted, tmp_path):
    """Three draft layers as DeepInfer's checkpoint holds them: the one target-feature projection in
    the first block, the heads in the last; shifted draft blocks (the default with shifted HC)
    hold no HC head. The layout survives the write -> load -> identical draft logits round trip."""
    model = tiny_model(seed=7, num_nextn_predict_layers=3, dspark_hc_shifted=draft_hc_shifted)
    names = set(official_state_dict(model))
    per_block = [{n.split(".", 2)[2] for n in names if n.startswith(f"mtp.{i}.")} for i in range(3)]
    first_only = {"main_proj.weight", "main_norm.weight"}
    last_only = {"norm.weight", "markov_head.embed.weight", "markov_head.head.weight", "confidence_head.proj.weight"}
    heads = {"hc_head_fn", "hc_head_base", "hc_head_scale"}
    last_only |= heads if draft_hc_shifted is False else set()
    assert per_block[0] - per_block[1] == first_only
    assert per_block[2] - per_block[1] == last_only
    assert per_block[1] == per_block[0] - first_only == per_block[2] - last_only
    assert not any(n.endswith(tuple(heads)) for n in names) or draft_hc_shifted is False

    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, OpTable("reference"), max_model_len=model.max_model_len)
    assert torch.equal(_draft_logits(model), _draft_logits(loaded))


def _draft_logits(model, prompt=tuple(range(3, 30)), block=5):
    from deepinfer.models.forward_context import ForwardContext

    runner = SequenceRunner(model, 1, 64)
    ctx = ForwardContext.for_sequences([list(prompt)], [0], [1], [runner.blocks(0)])
    ctx.write_draft_cache = True
    with torch.no_grad():
        model(ctx, runner.caches)
        ctx = ForwardContext.for_sequences([[prompt[-1]] + [model.draft_noise_token] * (block - 1)], [len(prompt)],
                                           [1], [runner.blocks(0)], decode=True)
        ctx.draft_block = block
        return model.draft_forward(ctx, runner.caches)[0]


def test_shifted_draft_blocks_read_the_embedding_itself():
    """Under shifted HC the first draft sublayer reads stream 0 (the embedding itself) by a one-hot
    mix; non-shifted draft blocks read with their own pre mix, a sigmoid-weighted sum of the four
    equal streams, which scales the embedding."""
    for shifted in (None, False):
        model, seen = tiny_model(seed=3, dspark_hc_shifted=shifted), []
        handle = model.mtp[0].attn_norm.register_forward_pre_hook(lambda _, args: seen.append(args[0]) and None)
        _draft_logits(model)
        handle.remove()
        embedded = model.embed.weight[[29] + [model.draft_noise_token] * 4]
        assert torch.equal(seen[0], embedded) == (shifted is None), shifted
