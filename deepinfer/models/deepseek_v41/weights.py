"""Official checkpoint names of a model's parameters, random format-exact weights, and loading."""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from deepinfer.hal import formats
from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.names import storage_format

_HC = re.compile(r"(hc_(?:attn|ffn|head))\.(fn|base|scale)$")
_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")


def official_state_dict(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under official checkpoint names (experts split one by one; views)."""
    out = {}
    for name, tensor in model.state_dict().items():
        stacked = _EXPERTS.match(name)
        if stacked:
            for e in range(tensor.shape[0]):
                out[f"{stacked.group(1)}.{e}.{stacked.group(2)}.weight"] = tensor[e]
        else:
            out[_HC.sub(r"\1_\2", name)] = tensor
    return out


def expected_shapes(model: DeepseekV41ForCausalLM) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every tensor a checkpoint of this model must hold."""
    return {name: tuple(t.shape) for name, t in official_state_dict(model).items()}


def load_official_state_dict(model: DeepseekV41ForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy official-named tensors into the model (shapes already checked by the loader)."""
    targets = official_state_dict(model)
    missing = sorted(set(targets) - set(tensors))
    unknown = sorted(set(tensors) - set(targets))
    if missing or unknown:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name])


def _random_like(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * noise
    if name.endswith("attn_sink"):
        return 0.5 * noise
    if name.endswith("gate.bias"):
        return 0.1 * noise
    if "hc_" in name:
        if leaf.endswith("fn"):
            return noise * 0.5 / math.sqrt(shape[-1])
        return 0.1 * noise if leaf.endswith("base") else 0.5 + 0.1 * noise.abs()
    if name == "embed.weight":
        return noise
    return noise / math.sqrt(shape[-1])


def representable(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` rounded to what the checkpoint format of ``name`` can hold (exact on reload)."""
    fmt = storage_format(name)
    if fmt == "fp8":
        return formats.dequantize_weight_fp8(*formats.quantize_weight_fp8(value))
    if fmt == "mxfp4":
        return formats.cast_back(value, "mxfp4", 32)
    if fmt == "bf16":
        return value.to(torch.bfloat16).float()
    return value.float()


def init_random_weights(model: DeepseekV41ForCausalLM, seed: int = 0) -> DeepseekV41ForCausalLM:
    """Fill every parameter with seeded random values that survive a checkpoint round trip."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in official_state_dict(model).items():
            tensor.copy_(representable(name, _random_like(name, tuple(tensor.shape), gen)))
    return model


def save_pretrained(model: DeepseekV41ForCausalLM, directory: str | Path, max_shard_bytes: int = 2**30) -> None:
    """Write ``model`` as an official-layout checkpoint (config.json, shards, index)."""
    from deepinfer.models.deepseek_v41.loader import save_checkpoint

    tensors = {name: t.detach().float().cpu() for name, t in official_state_dict(model).items()}
    save_checkpoint(directory, model.cfg.to_hf_dict(), tensors, max_shard_bytes=max_shard_bytes)


def load_pretrained(directory: str | Path, ops: OpTable, dtype: torch.dtype = torch.float32,
                    max_model_len: int = 4096, overrides: dict | None = None) -> DeepseekV41ForCausalLM:
    """Build the model a checkpoint directory describes and load its weights."""
    from deepinfer.models.deepseek_v41.loader import load_checkpoint

    config = DeepseekV41Config.from_json(Path(directory) / "config.json")
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    model = DeepseekV41ForCausalLM(config, ops, dtype=dtype, max_model_len=max_model_len)
    _, tensors = load_checkpoint(directory, expected_shapes(model), dtype=dtype)
    load_official_state_dict(model, tensors)
    return model


def inference_loss(model: DeepseekV41ForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy of token ``windows [n, L+1]`` by the inference forward
    (one full prefill per window over fresh paged caches, logits at every position)."""
    from deepinfer.models.deepseek_v41.config import PAGE_TOKENS
    from deepinfer.models.forward_context import ForwardContext

    blocks = math.ceil(windows.shape[1] / PAGE_TOKENS)
    caches = model.allocate_caches(1 + len(windows) * blocks, len(windows) + 1)
    ctx = ForwardContext.for_sequences([w[:-1].tolist() for w in windows], [0] * len(windows),
                                       list(range(1, len(windows) + 1)),
                                       [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(windows))],
                                       all_logits=True)
    with torch.no_grad():
        logits = model(ctx, caches)
    return torch.nn.functional.cross_entropy(logits, windows[:, 1:].reshape(-1)).item()
