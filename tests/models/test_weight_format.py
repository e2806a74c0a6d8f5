"""``model.weight_format``: the weights the official checkpoint quantizes stay quantized in memory
(from random weights and from a checkpoint), hold exactly the plain model's values, and give the
plain model's tokens."""
import json

import pytest
import torch
from safetensors import safe_open

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import ConfigError, ModelConfig
from deepinfer.hal.formats import Quantized, quantize
from deepinfer.hal.ops.grouped_gemm import values
from deepinfer.models.deepseek_v41.loader import load_checkpoint
from deepinfer.models.deepseek_v41.names import storage_format
from deepinfer.models.deepseek_v41.weights import hold_quantized, load_pretrained, official_state_dict, save_pretrained
from tests.models.tiny_model import SequenceRunner, tiny_model

EXPECTED_FORMATS = {"mxfp4": {"fp8": "fp8", "mxfp4": "mxfp4"}, "fp8": {"fp8": "fp8", "mxfp4": "fp8"}}
"""weight_format -> (the name's storage format -> the format it is held in)."""


@pytest.fixture(scope="module")
def plain():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def saved(plain, tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    save_pretrained(plain, directory, max_shard_bytes=512 * 1024)
    return directory


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4"])
def test_held_weights_keep_the_plain_values_in_the_checkpoint_formats(plain, weight_format):
    held = official_state_dict(hold_quantized(tiny_model(seed=3), weight_format))
    want = official_state_dict(plain)
    assert held.keys() == want.keys()
    quantized = 0
    for name, value in held.items():
        stored = storage_format(name)
        if stored in EXPECTED_FORMATS[weight_format]:
            assert isinstance(value, Quantized) and value.fmt == EXPECTED_FORMATS[weight_format][stored], name
            assert value.scale.shape[-1] * 32 == want[name].shape[-1], name
            quantized += 1
        else:
            assert isinstance(value, torch.Tensor), name
        assert torch.equal(values(value), want[name].float()), name
    assert quantized == sum(storage_format(n) in ("fp8", "mxfp4") for n in want)


def test_held_weights_take_less_memory(plain):
    def nbytes(model):
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())

    assert nbytes(hold_quantized(tiny_model(seed=3), "mxfp4")) < nbytes(hold_quantized(tiny_model(seed=3), "fp8")) \
        < nbytes(plain)


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4"])
def test_a_checkpoint_loads_quantized_and_computes_the_plain_logits(plain, saved, weight_format):
    model = load_pretrained(saved, plain.ops, weight_format=weight_format, max_model_len=1024)
    loaded, want = official_state_dict(model), official_state_dict(plain)
    for name, value in loaded.items():
        assert torch.equal(values(value), want[name].float()), name
    tokens = [5, 17, 3, 99, 42, 7, 250, 11, 64, 1]
    torch.testing.assert_close(SequenceRunner(model, 1, 16).step({0: tokens}, all_logits=True),
                               SequenceRunner(plain, 1, 16).step({0: tokens}, all_logits=True), rtol=0, atol=0)


def test_the_loader_hands_over_the_stored_bytes(saved):
    _, tensors = load_checkpoint(saved, quantized=True)
    expert, projection = "layers.1.ffn.experts.3.w2.weight", "layers.1.attn.wq_b.weight"
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(saved / index[expert]), "pt") as shard:
        stored = shard.get_tensor(expert)
    assert tensors[expert].fmt == "mxfp4" and torch.equal(tensors[expert].data, stored.view(torch.uint8))
    with safe_open(str(saved / index[projection]), "pt") as shard:
        data, scale = shard.get_tensor(projection), shard.get_tensor(projection.replace(".weight", ".scale"))
    held = tensors[projection]
    assert held.fmt == "fp8" and torch.equal(held.data.view(torch.uint8), data.view(torch.uint8))
    rows = torch.arange(data.shape[0]) // 32
    assert torch.equal(held.scale, scale.view(torch.uint8)[rows]), "each row takes its 32 x 32 block's scale"


def test_an_fp8_target_reencodes_mxfp4_experts_exactly(saved):
    _, tensors = load_checkpoint(saved, quantized=True)
    expert = tensors["layers.1.ffn.experts.0.w1.weight"]
    again = quantize(expert.dequantize(), "fp8", 32)
    assert torch.equal(again.dequantize(), expert.dequantize())


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4"])
def test_generation_with_held_weights_equals_the_plain_model(weight_format):
    prompts = [[1, 5, 9, 200, 17], [3, 4], list(range(40, 90))]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    quiet = ["engine.use_tqdm=false"]
    want = [o.token_ids for o in LLM("tiny_random", "reference", quiet).generate(prompts, params)]
    got = [o.token_ids for o in LLM("tiny_random", "reference", quiet + [f"model.weight_format={weight_format}"])
           .generate(prompts, params)]
    assert got == want


def test_an_unknown_weight_format_is_refused():
    with pytest.raises(ConfigError, match="model.weight_format='int4'"):
        ModelConfig(weight_format="int4")
    with pytest.raises(ValueError, match="weight_format"):
        hold_quantized(tiny_model(), "nvfp4")
