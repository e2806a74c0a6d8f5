"""Official checkpoint names of a model's parameters, random format-exact weights, and loading."""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from deepinfer.hal import formats
from deepinfer.hal.formats import Quantized
from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import EngramTable
from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.moe import Experts
from deepinfer.models.deepseek_v41.names import storage_format
from deepinfer.models.layers import Linear, quantized_operand

_HC = re.compile(r"(hc_(?:attn|ffn|head))\.(fn|base|scale)$")
_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")


WEIGHT_FORMATS = (None, "fp8", "mxfp4")
"""``model.weight_format`` values: None holds every weight in the model dtype; ``"fp8"`` and
``"mxfp4"`` keep the weights the official checkpoint quantizes quantized (:func:`hold_quantized`)."""


def official_state_dict(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor | Quantized]:
    """The model's tensors under official checkpoint names (experts split one by one; views).
    A weight held quantized is a :class:`~deepinfer.hal.formats.Quantized` of its data and scale."""
    tensors = model.state_dict()
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale"):
            continue
        scale = tensors.get(f"{name}_scale")
        stacked = _EXPERTS.match(name)
        if stacked:
            for e in range(tensor.shape[0]):
                out[f"{stacked.group(1)}.{e}.{stacked.group(2)}.weight"] = quantized_operand(
                    tensor[e], None if scale is None else scale[e])
        else:
            out[_HC.sub(r"\1_\2", name)] = quantized_operand(tensor, scale)
    return out


def expected_shapes(model: DeepseekV41ForCausalLM) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every tensor a checkpoint of this model must hold (the values'
    shape for a weight held quantized)."""
    return {name: _value_shape(t) for name, t in official_state_dict(model).items()}


def hold_quantized(model: DeepseekV41ForCausalLM, weight_format: str | None) -> DeepseekV41ForCausalLM:
    """Keep the weights the official checkpoint quantizes quantized in memory, encoded from their
    current values (exact for values the checkpoint formats hold, as :func:`init_random_weights`
    and the loader give them): with ``"mxfp4"`` the FP8 projections as FP8 (e4m3, UE8M0 per 32
    along K), the Engram tables as FP8 (UE8M0 per 32 values of a row) and the routed experts as
    MXFP4, the checkpoint's own formats; with ``"fp8"`` the experts as FP8 too. None leaves every
    weight plain."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"model.weight_format must be one of {list(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format is None:
        return model
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            module.hold_quantized(weight_format)
        elif isinstance(module, EngramTable):
            module.hold_quantized("fp8")
        elif isinstance(module, Linear) and storage_format(f"{name}.weight") == "fp8":
            module.hold_quantized("fp8")
    return model


def load_official_state_dict(model: DeepseekV41ForCausalLM, tensors: dict[str, torch.Tensor | Quantized]) -> None:
    """Copy official-named tensors (plain or Quantized) into the model (shapes already checked
    by the loader); a weight held quantized takes a Quantized value of its format as it is, and
    any other value encoded in its format."""
    targets = official_state_dict(model)
    missing = sorted(set(targets) - set(tensors))
    unknown = sorted(set(tensors) - set(targets))
    if missing or unknown:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
    with torch.no_grad():
        for name, target in targets.items():
            assign(target, tensors[name])


def assign(target: torch.Tensor | Quantized, value: torch.Tensor | Quantized) -> None:
    """Copy ``value`` into ``target`` in place: dequantized into a plain target, encoded in a
    quantized target's format unless it already is."""
    if isinstance(target, torch.Tensor):
        target.copy_(value.dequantize() if isinstance(value, Quantized) else value)
        return
    if not (isinstance(value, Quantized) and value.fmt == target.fmt and value.block == target.block):
        dense = value.dequantize() if isinstance(value, Quantized) else value
        value = formats.quantize(dense.float(), target.fmt, target.block)
    target.data.copy_(value.data.view(target.data.dtype))
    target.scale.copy_(value.scale)


def _value_shape(t: torch.Tensor | Quantized) -> tuple[int, ...]:
    if isinstance(t, Quantized):
        return (*t.data.shape[:-1], t.data.shape[-1] * (2 if t.fmt == "mxfp4" else 1))
    return tuple(t.shape)


def _random_like(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * noise
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return 1.0 + 0.1 * noise
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
    if fmt in ("mxfp4", "fp8_rows"):
        return formats.cast_back(value, "mxfp4" if fmt == "mxfp4" else "fp8", 32)
    if fmt == "bf16":
        return value.to(torch.bfloat16).float()
    return value.float()


def init_random_weights(model: DeepseekV41ForCausalLM, seed: int = 0) -> DeepseekV41ForCausalLM:
    """Fill every parameter with seeded random values that survive a checkpoint round trip."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in official_state_dict(model).items():
            assign(tensor, representable(name, _random_like(name, _value_shape(tensor), gen)))
    return model


def save_pretrained(model: DeepseekV41ForCausalLM, directory: str | Path, max_shard_bytes: int = 2**30) -> None:
    """Write ``model`` as an official-layout checkpoint (config.json, shards, index), with the
    ``tokenizer.json`` its Engram compressed vocabulary was built from when it has Engram layers."""
    from deepinfer.models.deepseek_v41.loader import save_checkpoint
    from deepinfer.tokenizer import TOKENIZER_FILE

    tokenizer = model.engram_vocab.tokenizer_json if model.engram_vocab is not None else None
    if model.cfg.engram_layer_ids and tokenizer is None:
        raise ValueError(f"this model's Engram layers {model.cfg.engram_layer_ids} hash through the identity "
                         f"vocabulary of a model without a tokenizer, and a checkpoint reads its compressed "
                         f"vocabulary from {TOKENIZER_FILE}: build the model with "
                         f"engram_vocab=CompressedVocab.from_tokenizer_file(...) to write it")
    tensors = {name: (t.dequantize() if isinstance(t, Quantized) else t).detach().float().cpu()
               for name, t in official_state_dict(model).items()}
    save_checkpoint(directory, model.cfg.to_hf_dict(), tensors, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None:
        (Path(directory) / TOKENIZER_FILE).write_text(tokenizer, encoding="utf-8")


def load_pretrained(directory: str | Path, ops: OpTable, dtype: torch.dtype = torch.float32,
                    max_model_len: int = 4096, overrides: dict | None = None,
                    weight_format: str | None = None) -> DeepseekV41ForCausalLM:
    """Build the model a checkpoint directory describes and load its weights; with a
    ``weight_format`` (:func:`hold_quantized`) the quantized weights go from disk to memory without
    being dequantized. A model with Engram layers reads its compressed vocabulary from the
    directory's ``tokenizer.json``."""
    from deepinfer.models.deepseek_v41.loader import LoaderError, load_checkpoint
    from deepinfer.tokenizer import TOKENIZER_FILE

    config = DeepseekV41Config.from_json(Path(directory) / "config.json")
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    vocab = None
    if config.engram_layer_ids:
        tokenizer = Path(directory) / TOKENIZER_FILE
        if not tokenizer.is_file():
            raise LoaderError(f"{directory} has no {TOKENIZER_FILE}, and its Engram layers {config.engram_layer_ids} "
                              f"hash token ids through the tokenizer's compressed vocabulary; put the model's "
                              f"{TOKENIZER_FILE} beside config.json")
        vocab = CompressedVocab.from_tokenizer_file(tokenizer)
    model = hold_quantized(DeepseekV41ForCausalLM(config, ops, dtype=dtype, max_model_len=max_model_len,
                                                  engram_vocab=vocab), weight_format)
    _, tensors = load_checkpoint(directory, expected_shapes(model), dtype=dtype, quantized=weight_format is not None)
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
