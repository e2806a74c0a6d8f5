"""Config keys of DeepInfer 0.1.0's V4.1 schema that this build does not implement are refused by
name, never dropped (issue 29)."""
import pytest

from deepinfer.models.registry import model_preset
from deepinfer.models.deepseek_v41.config import DeepseekV41Config


def _tiny(**changes) -> dict:
    return {**model_preset("tiny")["config"], **changes}


def test_candidate_block_top_k_is_refused_by_name():
    with pytest.raises(ValueError, match=r"candidate_source_layer_id=2: candidate-block top-k .* not supported yet"):
        DeepseekV41Config.from_dict(_tiny(candidate_source_layer_id=2, candidate_topk_blocks=64,
                                          candidate_block_size=64))


def test_a_config_without_candidate_blocks_loads_and_writes_the_keys_back():
    cfg = DeepseekV41Config.from_dict(_tiny(candidate_source_layer_id=None))
    text = cfg.to_hf_dict()["text_config"]
    assert text["candidate_source_layer_id"] is None and "index_k_source_layer_ids" in text


def test_index_key_sharing_across_layers_is_refused_by_name():
    ratios = DeepseekV41Config.from_dict(_tiny()).layer_ratios
    compressed = [i for i, r in enumerate(ratios) if r > 0]
    with pytest.raises(ValueError, match=r"index_k_source_layer_ids=.*cross-layer cache sharing is not supported"):
        DeepseekV41Config.from_dict(_tiny(index_k_source_layer_ids=[compressed[0]] * len(compressed)))
    assert DeepseekV41Config.from_dict(_tiny(index_k_source_layer_ids=compressed)).index_k_source_layer_ids == compressed
