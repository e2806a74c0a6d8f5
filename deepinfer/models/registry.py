"""Model architectures by name, and the bundled model presets under configs/model/."""
from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_ROOT = REPO_ROOT / "configs"
ARCHITECTURES = ("deepseek_v41",)


def model_preset(name: str) -> dict[str, Any]:
    """The ``configs/model/<name>.yaml`` preset as a plain dict."""
    from omegaconf import OmegaConf

    path = CONFIG_ROOT / "model" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (CONFIG_ROOT / "model").glob("*.yaml"))
        raise ValueError(f"unknown model {name!r}; bundled models: {known}, or pass a checkpoint directory")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def build_config(preset: dict[str, Any]):
    """The architecture config object of a model preset dict."""
    if preset.get("arch") not in ARCHITECTURES:
        raise ValueError(f"unknown model architecture {preset.get('arch')!r}; known: {list(ARCHITECTURES)}")
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config.from_dict(preset["config"])


def resolve_checkpoint(checkpoint: str | Path | None) -> Path | None:
    """The directory ``model.checkpoint`` names: absolute as given; a relative path from the current
    directory when it exists there, else from the repository root (where ``models/`` ships)."""
    if not checkpoint:
        return None
    path = Path(checkpoint).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def build_model(model_cfg, ops, device: str = "cpu", seed: int = 0):
    """Instantiate the model a ``model`` config section describes, on ``device``.

    With ``checkpoint`` set, the checkpoint's config.json and weights are used; otherwise the
    preset's architecture gets seeded random weights (and, with Engram layers, the identity
    compressed vocabulary: such a model has no tokenizer file). ``weight_format`` keeps the quantized
    weights quantized (``weights.hold_quantized``), ``expert_activation_format`` casts the experts'
    activations (``moe.cast_expert_activations``). Returns ``(model, has_random_weights)``."""
    import torch

    from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.models.deepseek_v41.moe import cast_expert_activations
    from deepinfer.models.deepseek_v41.weights import hold_quantized, init_random_weights, load_pretrained

    if model_cfg.arch not in ARCHITECTURES:
        raise ValueError(f"unknown model architecture {model_cfg.arch!r}; known: {list(ARCHITECTURES)}")
    dtype = getattr(torch, model_cfg.dtype)
    if model_cfg.checkpoint:
        model = load_pretrained(resolve_checkpoint(model_cfg.checkpoint), ops, dtype=dtype,
                                max_model_len=model_cfg.max_model_len, weight_format=model_cfg.weight_format)
        return cast_expert_activations(model, model_cfg.expert_activation_format).to(device), False
    config = build_config({"arch": model_cfg.arch, "config": dict(model_cfg.config)})
    vocab = CompressedVocab.identity(config.vocab_size) if config.engram_layer_ids else None
    model = DeepseekV41ForCausalLM(config, ops, dtype=dtype, max_model_len=model_cfg.max_model_len,
                                   engram_vocab=vocab)
    model = hold_quantized(init_random_weights(model, seed), model_cfg.weight_format)
    return cast_expert_activations(model, model_cfg.expert_activation_format).to(device), True
