import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.hal import formats
from deepinfer.models.deepseek_v41.loader import (
    INDEX_FILE, SINGLE_FILE, LoaderError, load_checkpoint, save_checkpoint,
)

FP8_WQ_A = "layers.0.attn.wq_a.weight"
FP8_WKV = "layers.0.attn.wkv.weight"
EXPERT_W1 = "layers.0.ffn.experts.0.w1.weight"
EXPERT_W2 = "layers.0.ffn.experts.0.w2.weight"
HC_FN = "layers.0.hc_attn_fn"
GATE_BIAS = "layers.0.ffn.gate.bias"
ATTN_NORM = "layers.0.attn_norm.weight"
EMBED = "embed.weight"
CONFIG = {"num_hidden_layers": 1, "quantization_config": {
    "quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
    "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}}
SMALL_SHARD = 4096


def _varied(gen, rows, columns):
    """Normal values whose rows span several powers of two, so block scales differ."""
    return torch.randn(rows, columns, generator=gen) * 2.0 ** torch.randint(-6, 6, (rows, 1), generator=gen)


def representable_state(gen):
    """Official names covering every storage format, with values each format holds exactly."""
    return {
        FP8_WQ_A: formats.dequantize_weight_fp8(*formats.quantize_weight_fp8(_varied(gen, 64, 96))),
        FP8_WKV: formats.dequantize_weight_fp8(*formats.quantize_weight_fp8(_varied(gen, 40, 72))),
        EXPERT_W1: formats.cast_back(_varied(gen, 32, 64), "mxfp4"),
        EXPERT_W2: formats.cast_back(_varied(gen, 16, 96), "mxfp4"),
        HC_FN: torch.randn(24, 64, generator=gen),
        GATE_BIAS: torch.randn(8, generator=gen),
        ATTN_NORM: torch.randn(64, generator=gen).bfloat16().float(),
        EMBED: torch.randn(100, 64, generator=gen).bfloat16().float(),
    }


@pytest.fixture
def state(gen):
    return representable_state(gen)


@pytest.fixture
def saved(tmp_path, state):
    save_checkpoint(tmp_path, CONFIG, state, max_shard_bytes=SMALL_SHARD)
    return tmp_path


def weight_map(directory):
    return json.loads((directory / INDEX_FILE).read_text())["weight_map"]


def disk_headers(directory):
    """Stored name -> (safetensors dtype string, shape, file), read from every shard."""
    headers = {}
    for file in sorted(set(weight_map(directory).values())):
        with safe_open(str(directory / file), framework="pt") as shard:
            for key in shard.keys():
                header = shard.get_slice(key)
                headers[key] = (header.get_dtype(), tuple(header.get_shape()), file)
    return headers


def edit_shard(directory, key, edit):
    """Rewrite the shard holding ``key``: ``edit(tensors)`` changes the shard's dict in place."""
    index = json.loads((directory / INDEX_FILE).read_text())
    file = index["weight_map"][key]
    with safe_open(str(directory / file), framework="pt") as shard:
        tensors = {name: shard.get_tensor(name) for name in shard.keys()}
    edit(tensors)
    save_file(tensors, str(directory / file))
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != file or k in tensors}
    (directory / INDEX_FILE).write_text(json.dumps(index))
    return file


def assert_loader_error(directory, *fragments, **kwargs):
    with pytest.raises(LoaderError) as caught:
        load_checkpoint(directory, **kwargs)
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {caught.value}"


def test_round_trip_is_bit_exact_across_shards(saved, state):
    config, loaded = load_checkpoint(saved, {name: tuple(t.shape) for name, t in state.items()})
    assert config == CONFIG
    assert len(set(weight_map(saved).values())) >= 3
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor), name


def test_files_are_named_and_indexed_as_official(saved):
    files = sorted(set(weight_map(saved).values()))
    count = len(files)
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    headers = disk_headers(saved)
    assert headers.keys() == weight_map(saved).keys()
    sizes = [math.prod(shape) * {"F32": 4, "BF16": 2}.get(dtype, 1) for dtype, shape, _ in headers.values()]
    assert json.loads((saved / INDEX_FILE).read_text())["metadata"]["total_size"] == sum(sizes)


def test_on_disk_dtypes_and_shapes(saved):
    headers = disk_headers(saved)
    assert headers[FP8_WQ_A][:2] == ("F8_E4M3", (64, 96))
    assert headers["layers.0.attn.wq_a.scale"][:2] == ("F8_E8M0", (2, 3))
    assert headers[FP8_WKV][:2] == ("F8_E4M3", (40, 72))
    assert headers["layers.0.attn.wkv.scale"][:2] == ("F8_E8M0", (2, 3))
    assert headers[EXPERT_W1][:2] == ("U8", (32, 32))
    assert headers["layers.0.ffn.experts.0.w1.scale"][:2] == ("F8_E8M0", (32, 2))
    assert headers[EXPERT_W2][:2] == ("U8", (16, 48))
    assert headers["layers.0.ffn.experts.0.w2.scale"][:2] == ("F8_E8M0", (16, 3))
    assert headers[HC_FN][:2] == ("F32", (24, 64))
    assert headers[GATE_BIAS][:2] == ("F32", (8,))
    assert headers[ATTN_NORM][:2] == ("BF16", (64,))
    assert headers[EMBED][:2] == ("BF16", (100, 64))
    for key, (_, _, file) in headers.items():
        if key.endswith(".scale"):
            assert headers[key.removesuffix(".scale") + ".weight"][2] == file, key


def test_hand_worked_fp8_and_mxfp4_bytes(tmp_path):
    fp8_weight = torch.tensor([[896.0, -1.0, 0.0]])
    expert = torch.zeros(1, 32)
    expert[0, :4] = torch.tensor([0.5, 6.0, -1.0, 0.0])
    save_checkpoint(tmp_path, {}, {FP8_WQ_A: fp8_weight, EXPERT_W1: expert})
    with safe_open(str(tmp_path / "model-00001-of-00001.safetensors"), framework="pt") as shard:
        assert shard.get_tensor("layers.0.attn.wq_a.scale").view(torch.uint8).tolist() == [[128]]
        assert shard.get_tensor(FP8_WQ_A).float().tolist() == [[448.0, -0.5, 0.0]]
        assert shard.get_tensor("layers.0.ffn.experts.0.w1.scale").view(torch.uint8).tolist() == [[127]]
        # 0.5 -> code 1, 6 -> code 7: byte 0x71; -1 -> code 0b1010, 0 -> 0: byte 0x0A
        assert shard.get_tensor(EXPERT_W1)[0, :3].tolist() == [0x71, 0x0A, 0]
    _, loaded = load_checkpoint(tmp_path)
    assert torch.equal(loaded[FP8_WQ_A], fp8_weight)
    assert torch.equal(loaded[EXPERT_W1], expert)


def test_writer_really_quantizes(tmp_path, gen):
    signs = torch.randint(0, 2, (64, 96), generator=gen) * 2 - 1
    weight = (1 + torch.rand(64, 96, generator=gen)) * signs
    save_checkpoint(tmp_path, {}, {FP8_WQ_A: weight, ATTN_NORM: torch.full((4,), 1 + 2**-10)})
    _, loaded = load_checkpoint(tmp_path)
    assert not torch.equal(loaded[FP8_WQ_A], weight)
    assert ((loaded[FP8_WQ_A] - weight).abs() / weight.abs()).max() <= 2**-3
    assert torch.equal(loaded[ATTN_NORM], torch.ones(4))


def test_model_prefix_is_stripped(tmp_path, state):
    save_checkpoint(tmp_path, CONFIG, {f"model.{name}": t for name, t in state.items()}, SMALL_SHARD)
    assert "model.layers.0.attn.wq_a.scale" in weight_map(tmp_path)
    _, loaded = load_checkpoint(tmp_path, {name: tuple(t.shape) for name, t in state.items()})
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], t) for name, t in state.items())


def test_single_file_without_index(tmp_path, state):
    save_checkpoint(tmp_path, CONFIG, state)
    (tmp_path / "model-00001-of-00001.safetensors").rename(tmp_path / SINGLE_FILE)
    (tmp_path / INDEX_FILE).unlink()
    _, loaded = load_checkpoint(tmp_path)
    assert all(torch.equal(loaded[name], t) for name, t in state.items())


def test_dtype_and_device_choice(saved, state):
    _, loaded = load_checkpoint(saved, dtype=torch.bfloat16, device="cpu")
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.bfloat16 and loaded[name].device.type == "cpu"
        assert torch.equal(loaded[name], tensor.bfloat16()), name


def test_int8_packed_fp4_and_uint8_scales_are_accepted(saved, state):
    def reinterpret(tensors):
        tensors[EXPERT_W1] = tensors[EXPERT_W1].view(torch.int8)
        tensors["layers.0.ffn.experts.0.w1.scale"] = tensors["layers.0.ffn.experts.0.w1.scale"].view(torch.uint8)
    edit_shard(saved, EXPERT_W1, reinterpret)
    _, loaded = load_checkpoint(saved)
    assert torch.equal(loaded[EXPERT_W1], state[EXPERT_W1])


def test_missing_shard(saved):
    file = weight_map(saved)[EMBED]
    (saved / file).unlink()
    assert_loader_error(saved, file, EMBED)


@pytest.mark.parametrize("keep_bytes", [0, 40, -100])
def test_corrupt_or_truncated_shard(saved, keep_bytes):
    file = weight_map(saved)[FP8_WQ_A]
    content = (saved / file).read_bytes()
    (saved / file).write_bytes(content[:keep_bytes] if keep_bytes else b"not a safetensors file" * 4)
    assert_loader_error(saved, file, FP8_WQ_A)


def test_shape_differs_from_expected(saved, state):
    expected = {name: tuple(t.shape) for name, t in state.items()}
    expected[EXPERT_W2] = (16, 48)
    assert_loader_error(saved, weight_map(saved)[EXPERT_W2], EXPERT_W2, "(16, 96)", "expected (16, 48)",
                        expected_shapes=expected)


def test_unknown_tensor(saved, state):
    expected = {name: tuple(t.shape) for name, t in state.items() if name != GATE_BIAS}
    assert_loader_error(saved, weight_map(saved)[GATE_BIAS], GATE_BIAS, "unknown", expected_shapes=expected)


def test_expected_tensor_absent(saved, state):
    expected = {name: tuple(t.shape) for name, t in state.items()}
    expected["head.weight"] = (100, 64)
    assert_loader_error(saved, INDEX_FILE, "head.weight", "absent", expected_shapes=expected)


def test_weight_without_scale(saved):
    file = edit_shard(saved, FP8_WKV, lambda tensors: tensors.pop("layers.0.attn.wkv.scale"))
    assert_loader_error(saved, file, FP8_WKV, "layers.0.attn.wkv.scale")


def test_scale_without_weight(saved):
    file = edit_shard(saved, EXPERT_W2, lambda tensors: tensors.pop(EXPERT_W2))
    assert_loader_error(saved, file, "layers.0.ffn.experts.0.w2.scale", EXPERT_W2)


def test_scale_of_unquantized_weight(saved):
    file = edit_shard(saved, ATTN_NORM, lambda tensors: tensors.update({"layers.0.attn_norm.scale": torch.ones(1)}))
    assert_loader_error(saved, file, "layers.0.attn_norm.scale")


def test_scale_of_wrong_shape(saved):
    scale = "layers.0.attn.wq_a.scale"
    file = edit_shard(saved, scale, lambda tensors: tensors.update({scale: tensors[scale][:1]}))
    assert_loader_error(saved, file, scale, "(1, 3)", "expected (2, 3)")


@pytest.mark.parametrize("name, stored_as, found", [
    (ATTN_NORM, torch.float16, "F16"),
    (HC_FN, torch.bfloat16, "BF16"),
    (FP8_WQ_A, torch.bfloat16, "BF16"),
    (EXPERT_W1, torch.int32, "I32"),
    ("layers.0.attn.wq_a.scale", torch.float32, "F32"),
])
def test_unexpected_dtype(saved, name, stored_as, found):
    file = edit_shard(saved, name, lambda tensors: tensors.update({name: tensors[name].to(stored_as)}))
    assert_loader_error(saved, file, name, found)


def test_a_tensor_stored_in_two_shards_is_refused(saved):
    """The same name in two shards (one of them listing it in the index): the loader names both."""
    embed_file = weight_map(saved)[EMBED]
    other = next(f for f in sorted(set(weight_map(saved).values())) if f != embed_file)
    with safe_open(str(saved / embed_file), framework="pt") as shard:
        embed = shard.get_tensor(EMBED)
    some_key = next(k for k, f in weight_map(saved).items() if f == other)
    edit_shard(saved, some_key, lambda tensors: tensors.update({EMBED: embed}))
    assert_loader_error(saved, EMBED, "also stored in", embed_file, other)


def test_index_lists_a_tensor_its_shard_lacks(saved):
    index = json.loads((saved / INDEX_FILE).read_text())
    index["weight_map"]["head.weight"] = index["weight_map"][EMBED]
    (saved / INDEX_FILE).write_text(json.dumps(index))
    assert_loader_error(saved, index["weight_map"][EMBED], "head.weight", INDEX_FILE)


def test_config_problems(saved):
    config = dict(CONFIG, quantization_config=dict(CONFIG["quantization_config"], weight_block_size=[128, 128]))
    (saved / "config.json").write_text(json.dumps(config))
    assert_loader_error(saved, "config.json", "weight_block_size")
    (saved / "config.json").unlink()
    assert_loader_error(saved, "config.json", "missing")


def test_empty_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert_loader_error(tmp_path, INDEX_FILE, SINGLE_FILE)


@pytest.mark.parametrize("state_dict, max_shard_bytes, message", [
    ({EMBED: torch.ones(2, 2)}, 0, "max_shard_bytes"),
    ({}, 1024, "empty"),
    ({EMBED: torch.ones(2, 2, dtype=torch.int64)}, 1024, EMBED),
    ({EXPERT_W1: torch.ones(4, 48)}, 1024, "multiple of 32"),
    ({FP8_WQ_A: torch.ones(4, 48, 2)}, 1024, FP8_WQ_A),
])
def test_writer_rejects_bad_input(tmp_path, state_dict, max_shard_bytes, message):
    with pytest.raises(ValueError, match=message):
        save_checkpoint(tmp_path, {}, state_dict, max_shard_bytes)
