"""Config keys of DeepInfer 0.1.0's V4.1 schema that this build does not implement are refused by
name, never dropped (issue 29)."""
import pytest

from deepinfer.models.registry import model_preset
from deepinfer.models.deepseek_v41.config import DeepseekV41Config


def _tiny(**changes) -> dict:
    return {**model_preset("tiny")["config"], **changes}


def test_a_config_without_candidate_blocks_loads_and_writes_the_keys_back():
    cfg = DeepseekV41Config.from_dict(_tiny(candidate_source_layer_id=None))
    text = cfg.to_hf_dict()["text_config"]
    assert text["candidate_source_layer_id"] is None and "index_k_source_layer_ids" in text


def _official(**text_changes) -> dict:
    """An HF config.json as V4.1 checkpoints lay it out: text_config beside the top-level keys."""
    cfg = DeepseekV41Config.from_dict(_tiny())
    values = cfg.to_hf_dict()
    values["text_config"].update(attention_bias=False, attention_dropout=0.0, dspark_target_attn_input=True,
                                 engram_max_ngram_size=3, engram_vocab_size=1000)
    values["text_config"].update(text_changes)
    values.update(image_token_id=128815, vision_config={"patch_size": 14}, transformers_version="4.57.0")
    return values


def test_every_key_of_deepinfers_schema_is_read_or_checked():
    cfg = DeepseekV41Config.from_dict(_official())
    assert cfg.num_hidden_layers == _tiny()["num_hidden_layers"]


@pytest.mark.parametrize("key,value", [("attention_bias", True), ("attention_dropout", 0.1),
                                       ("dspark_target_attn_input", False)])
def test_a_checked_key_with_another_value_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=rf"{key}={value!r} \(only .* is implemented\)"):
        DeepseekV41Config.from_dict(_official(**{key: value}))


def test_an_unknown_key_is_refused_by_name_not_dropped():
    with pytest.raises(ValueError, match=r"unknown keys \['sliding_window_pattern'\]"):
        DeepseekV41Config.from_dict(_official(sliding_window_pattern=4))
    with pytest.raises(ValueError, match=r"unknown keys \['qk_nope_scale'\]"):
        DeepseekV41Config.from_dict(_tiny(qk_nope_scale=2.0))  # a flat preset dict too
    values = _official()
    values["speculative_config"] = {"method": "mtp"}
    with pytest.raises(ValueError, match=r"unknown top-level keys \['speculative_config'\]"):
        DeepseekV41Config.from_dict(values)


def test_another_quantization_or_dtype_is_refused():
    values = _official()
    values["quantization_config"] = {**values["quantization_config"], "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"quantization_config=.*128, 128"):
        DeepseekV41Config.from_dict(values)
    values = _official()
    values["dtype"] = "float16"
    with pytest.raises(ValueError, match=r"dtype='float16'"):
        DeepseekV41Config.from_dict(values)


def test_tied_embeddings_and_non_yarn_rope_scaling_are_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        DeepseekV41Config.from_dict(_tiny(tie_word_embeddings=True))
    yarn = {"factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
    assert DeepseekV41Config.from_dict(_tiny(rope_scaling={**yarn, "type": "yarn"})).rope_scaling["factor"] == 16
    with pytest.raises(ValueError, match=r"rope_scaling .* unknown keys \['mscale'\]"):
        DeepseekV41Config.from_dict(_tiny(rope_scaling={**yarn, "mscale": 1.0}))
    with pytest.raises(ValueError, match=r"type 'linear'"):
        DeepseekV41Config.from_dict(_tiny(rope_scaling={**yarn, "type": "linear"}))
