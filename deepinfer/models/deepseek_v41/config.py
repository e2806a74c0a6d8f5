"""DeepSeek-V4.1 model configuration: the HF ``config.json`` keys we read, plus runtime choices."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from deepinfer.hal.ops.mhc import SINKHORN_ORDERS

ATTENTION_DIM = 512
ROPE_DIM = 64
INDEX_HEAD_DIM = 128
PAGE_TOKENS = 128


ROPE_SCALING_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "type", "rope_type"}
REQUIRED_VALUES = {"attention_bias": False, "attention_dropout": 0.0, "dspark_target_attn_input": True}
"""Keys of DeepInfer's schema that this build reads only to check: the one value it implements."""
ENGRAM_SCALE_BLOCK = 32
"""Values per UE8M0 scale in a row of an Engram table (the official FP8 table format)."""
HF_BOOKKEEPING = {"architectures", "model_type", "transformers_version", "torch_dtype", "use_cache",
                  "initializer_range", "auto_map", "_name_or_path"}
"""HF bookkeeping keys that say nothing about the computation."""
TOP_LEVEL = {"text_config", "dtype", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id",
             "image_token_id", "vision_config", "deepinfer_training"}
"""Keys beside ``text_config``. ``image_token_id`` and ``vision_config`` describe the vision tower, which
this text-only build does not load (image inputs are refused by the engine); ``deepinfer_training``
is the record our trainer writes."""
QUANTIZATION = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
"""The one ``quantization_config`` of V4.1 checkpoints (FP8 32x32 UE8M0 weights, MXFP4 experts)."""


def check_config_keys(values: dict[str, Any]) -> None:
    """Refuse, by name, every key of an HF ``config.json`` dict (its ``text_config`` if present,
    else the flat dict) that this build neither reads nor checks, and every checked key with a
    value other than the one implemented."""
    fields = {f.name for f in dataclasses.fields(DeepseekV41Config)}
    text, problems = values.get("text_config", values), []
    unknown = sorted(set(text) - fields - set(REQUIRED_VALUES) - HF_BOOKKEEPING)
    if unknown:
        problems.append(f"unknown keys {unknown} (not in DeepSeek-V4.1's config schema as this build reads it)")
    for key, value in REQUIRED_VALUES.items():
        if key in text and text[key] != value:
            problems.append(f"{key}={text[key]!r} (only {value!r} is implemented)")
    if "text_config" in values:
        extra = sorted(set(values) - TOP_LEVEL - HF_BOOKKEEPING)
        if extra:
            problems.append(f"unknown top-level keys {extra}")
        if values.get("dtype", "bfloat16") != "bfloat16":
            problems.append(f"dtype={values['dtype']!r} (V4.1 checkpoints are bfloat16 beside their FP8 weights)")
        if "quantization_config" in values and values["quantization_config"] != QUANTIZATION:
            problems.append(f"quantization_config={values['quantization_config']} (only {QUANTIZATION} is read)")
    if problems:
        raise ValueError("config.json: " + "; ".join(problems) + ". Fix the config, or extend "
                         "deepinfer/models/deepseek_v41/config.py to implement what it asks for")


class LayerSources(NamedTuple):
    """The layers whose caches and indices a compressed layer uses: ``kv`` (compressed KV),
    ``index_k`` (the indexer's keys), ``topk`` (its selected keys)."""

    kv: int
    index_k: int
    topk: int

    def shares(self, layer: int) -> bool:
        """Whether ``layer`` (whose sources these are) reads anything of an earlier layer."""
        return self != (layer, layer, layer)


@dataclass
class DeepseekV41Config:
    """Architecture of a DeepSeek-V4.1-family model (field names follow the HF ``text_config``).

    ``compress_ratios[i]`` is 0 (SWA only), 1 or 2 for backbone layer ``i``; the first layer with
    ratio 1 starts the YOCO consumer half. Runtime fields (not in checkpoints) come last."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = ATTENTION_DIM
    qk_rope_head_dim: int = ROPE_DIM
    q_lora_rank: int = 1280
    o_lora_rank: int = 512
    o_groups: int = 8
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    tie_word_embeddings: bool = False
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None
    compress_ratios: list[int] = field(default_factory=list)
    index_topk: int = 512
    index_n_heads: int = 64
    index_head_dim: int = INDEX_HEAD_DIM
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    hc_sinkhorn_order: str = "deepinfer"  # or "column_row" (models/tiny/config.json)
    hc_shifted: bool = True
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    shared_expert_intermediate_size: int | None = None
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int = 64
    dspark_noise_token_id: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    dspark_hc_shifted: bool | None = None  # None: as hc_shifted; models/tiny/config.json: false
    use_fp4_sparse_kv: bool = True
    kv_source_layer_ids: list[int] | None = None
    index_source_layer_ids: list[int] | None = None
    index_k_source_layer_ids: list[int] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_max_ngram_size: int = 3
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int | None = None
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # runtime choices, not read from checkpoints
    max_backtracking: int = 6
    swa_cache_format: str = "fp8"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_lora_rank(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def layer_ratios(self) -> list[int]:
        return list(self.compress_ratios[: self.num_hidden_layers])

    @property
    def n_prefill_layers(self) -> int:
        """Index of the first YOCO consumer layer (the first layer with compression ratio 1)."""
        return self.layer_ratios.index(1)

    @property
    def swa_ring_size(self) -> int:
        return self.sliding_window + self.max_backtracking

    @property
    def shared_width(self) -> int:
        return self.shared_expert_intermediate_size or self.moe_intermediate_size * self.n_shared_experts

    @property
    def draft_hc_shifted(self) -> bool:
        """Whether the draft blocks run shifted HC (DeepInfer: whenever the backbone does): the first
        block reads stream 0, the last hands on its pre-layer mix and no ``hc_head`` exists. Non-shifted
        draft blocks read with their own pre mixes and the last one holds ``hc_head_{fn,base,scale}``."""
        return self.hc_shifted if self.dspark_hc_shifted is None else self.dspark_hc_shifted

    @property
    def compressed_cache_format(self) -> str:
        return "fp4" if self.use_fp4_sparse_kv else "fp8"

    @property
    def draft_experts(self) -> tuple[int, int]:
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_num_experts_per_tok or self.num_experts_per_tok)

    def compress_state_ring(self, ratio: int) -> int:
        """Raw (score, latent) entries kept per sequence for a layer of this ratio."""
        return ratio + max(0, self.max_backtracking - 1)

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"invalid DeepSeek-V4.1 config: {what}")

        need(self.head_dim == ATTENTION_DIM and self.qk_rope_head_dim == ROPE_DIM,
             f"head_dim must be 512 with 64 RoPE dims (the V4.1 KV formats), got {self.head_dim}/{self.qk_rope_head_dim}")
        need(self.num_key_value_heads == 1, f"num_key_value_heads must be 1 (MQA), got {self.num_key_value_heads}")
        need(self.index_head_dim == INDEX_HEAD_DIM, f"index_head_dim must be 128, got {self.index_head_dim}")
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(self.scoring_func == "sqrtsoftplus" and self.topk_method == "noaux_tc",
             f"the gate must be sqrtsoftplus + noaux_tc, got {self.scoring_func!r} + {self.topk_method!r}")
        need(len(self.compress_ratios) >= self.num_hidden_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} layers")
        need(set(self.layer_ratios) <= {0, 1, 2}, f"only ratios 0, 1, 2 exist in V4.1, got {sorted(set(self.layer_ratios))}")
        need(1 in self.layer_ratios, "compress_ratios needs a ratio-1 layer (it starts the YOCO consumer half)")
        need(self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of o_groups {self.o_groups}")
        need(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok must be in 1..n_routed_experts")
        need(all(0 <= i < self.num_hidden_layers for i in self.dspark_target_layer_ids),
             f"dspark_target_layer_ids {self.dspark_target_layer_ids} must name backbone layers")
        need(self.max_backtracking >= 1, "max_backtracking must be >= 1")
        need(self.hc_sinkhorn_order in SINKHORN_ORDERS,
             f"hc_sinkhorn_order must be one of {list(SINKHORN_ORDERS)}, got {self.hc_sinkhorn_order!r}")
        need(not self.tie_word_embeddings, "tie_word_embeddings=true: V4.1 checkpoints hold their own head.weight "
                                           "beside embed.weight, and this build never ties them")
        if self.rope_scaling:
            extra = sorted(set(self.rope_scaling) - ROPE_SCALING_KEYS)
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type", "yarn"))
            need(not extra and kind == "yarn",
                 f"rope_scaling is YaRN with keys {sorted(ROPE_SCALING_KEYS)}; got type {kind!r} and unknown keys "
                 f"{extra}")
        self._check_engram(need)
        self._check_sources(need)
        self._check_candidates(need)

    def _check_engram(self, need) -> None:
        """Engram as DeepInfer builds it: distinct backbone layers, n-gram orders 2..N, tables of
        at least ``engram_vocab_size`` rows per head whose rows are FP8 with a scale per 32
        values, a pad token of the vocabulary, and the compressed tokenizer on."""
        layers = self.engram_layer_ids
        if not layers:
            return
        need(len(set(layers)) == len(layers) and all(isinstance(i, int) and 0 <= i < self.num_hidden_layers
                                                     for i in layers),
             f"engram_layer_ids={layers} must name distinct backbone layers 0..{self.num_hidden_layers - 1}")
        need(self.hc_mult > 1, f"Engram gates each of hc_mult > 1 streams, got hc_mult={self.hc_mult}")
        sizes = {"engram_max_ngram_size": (self.engram_max_ngram_size, 2),
                 "engram_vocab_size": (self.engram_vocab_size, 2), "engram_n_heads": (self.engram_n_heads, 1),
                 "engram_head_dim": (self.engram_head_dim, ENGRAM_SCALE_BLOCK)}
        for key, (value, least) in sizes.items():
            need(isinstance(value, int) and value >= least,
                 f"{key}={value!r}: Engram layers {layers} need it as an int >= {least}")
        need(self.engram_head_dim % ENGRAM_SCALE_BLOCK == 0,
             f"engram_head_dim={self.engram_head_dim} must be a multiple of {ENGRAM_SCALE_BLOCK} (the tables' FP8 "
             f"rows carry one UE8M0 scale per {ENGRAM_SCALE_BLOCK} values)")
        need(isinstance(self.engram_pad_token_id, int) and 0 <= self.engram_pad_token_id < self.vocab_size,
             f"engram_pad_token_id={self.engram_pad_token_id!r} must be a token id of the vocabulary "
             f"0..{self.vocab_size - 1}")
        need(isinstance(self.engram_compressed_vocab_size, int) and self.engram_compressed_vocab_size > 0,
             f"engram_compressed_vocab_size={self.engram_compressed_vocab_size!r}: Engram hashes token ids of the "
             f"compressed tokenizer (DeepInfer runs it only with tokenizer compression on); set it to the size of "
             f"the compressed vocabulary")

    @property
    def engram_tables(self) -> int:
        """Tables per Engram layer: one per n-gram order 2..N and head."""
        return (self.engram_max_ngram_size - 1) * (self.engram_n_heads or 0)

    @property
    def engram_history_tokens(self) -> int:
        """Token ids kept per sequence slot for Engram's n-grams: the N - 1 before a step's first
        row, plus the rows of a verify step (at most ``max_backtracking``) whose drafts may be
        rejected."""
        return self.max_backtracking + self.engram_max_ngram_size - 1

    def _check_candidates(self, need) -> None:
        """Candidate-block top-k: the source layer selects its own keys; the later layers that
        select theirs (of the source's ratio, so that the blocks mean the same keys) score only
        inside the ``candidate_topk_blocks`` blocks it chose, which hold at least ``index_topk``
        keys whenever they restrict anything."""
        source = self.candidate_source_layer_id
        if source is None:
            return
        ratios, blocks, size = self.layer_ratios, self.candidate_topk_blocks, self.candidate_block_size
        topk_sources = self._source_lists()[2]
        need(source in topk_sources, f"candidate_source_layer_id={source} must be a compressed layer that selects its "
                                     f"own keys (one of {topk_sources})")
        need(isinstance(blocks, int) and isinstance(size, int) and blocks >= 1 and size >= 1,
             f"candidate_topk_blocks and candidate_block_size must be ints >= 1, got {blocks!r} and {size!r}")
        need(blocks * size >= self.index_topk + size - 1,
             f"candidate_topk_blocks * candidate_block_size = {blocks * size} must hold index_topk + block_size - 1 "
             f"= {self.index_topk + size - 1} keys (the last block may be partial), so that restricted layers "
             f"still find index_topk keys")
        later = [layer for layer in topk_sources if layer > source and ratios[layer] != ratios[source]]
        need(not later, f"candidate-block top-k for layers of another ratio than the source's ({later}, source "
                        f"{source} of ratio {ratios[source]}) is not supported yet")

    def _check_sources(self, need) -> None:
        """Cross-layer sharing as DeepInfer's ``SharedLayerTopology`` allows it: each list names
        compressed layers in increasing order, starting with the first; a layer shares with the
        nearest source at or before it, of its own ratio; top-k sources include the index-K
        sources, which include the KV sources; the first YOCO consumer is a KV source."""
        ratios, compressed = self.layer_ratios, [i for i, r in enumerate(self.layer_ratios) if r > 0]
        for key in ("kv_source_layer_ids", "index_k_source_layer_ids", "index_source_layer_ids"):
            sources = getattr(self, key)
            if sources is None:
                continue
            need(list(sources) == sorted(set(sources)) and set(sources) <= set(compressed)
                 and (not compressed or sources[:1] == compressed[:1]),
                 f"{key}={sources} must list compressed layers (of {compressed}) in increasing order, starting "
                 f"with the first")
        kv, index_k, topk = self._source_lists()
        need(set(kv) <= set(index_k) <= set(topk),
             f"sharing segments must refine each other: the KV sources {kv} must be index-K sources {index_k}, "
             f"and those top-k sources {topk}")
        need(not compressed or self.n_prefill_layers in kv,
             f"the first YOCO consumer layer {self.n_prefill_layers if compressed else None} must be a KV source "
             f"({kv}): no cache is shared across the YOCO boundary")
        for layer, shared in self.layer_sources.items():
            bad = {name: s for name, s in zip(("kv", "index_k", "topk"), shared) if ratios[s] != ratios[layer]}
            need(not bad, f"layer {layer} (ratio {ratios[layer]}) would share with layers of another ratio: {bad}")

    def _source_lists(self) -> tuple[list[int], list[int], list[int]]:
        compressed = [i for i, r in enumerate(self.layer_ratios) if r > 0]
        kv = list(self.kv_source_layer_ids if self.kv_source_layer_ids is not None else compressed)
        index_k = list(self.index_k_source_layer_ids if self.index_k_source_layer_ids is not None else kv)
        topk = list(self.index_source_layer_ids if self.index_source_layer_ids is not None else compressed)
        return kv, index_k, topk

    @property
    def layer_sources(self) -> dict[int, "LayerSources"]:
        """For each compressed backbone layer, the layers whose compressed KV, index K and top-k
        indices it uses (itself where it is a source): the nearest source at or before it."""
        lists = self._source_lists()

        def nearest(sources: list[int], layer: int) -> int:
            return max((s for s in sources if s <= layer), default=layer)

        return {layer: LayerSources(*(nearest(sources, layer) for sources in lists))
                for layer, ratio in enumerate(self.layer_ratios) if ratio > 0}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DeepseekV41Config":
        """Build from an HF ``config.json`` dict (``text_config`` if present) or a flat dict.

        Every key is used, checked or refused by name (:func:`check_config_keys`): a key this
        build does not know is an error, never dropped."""
        check_config_keys(values)
        flat = dict(values.get("text_config", values))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in values and key not in flat:
                flat[key] = values[key]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in flat.items() if k in known})

    @classmethod
    def from_json(cls, path: str | Path) -> "DeepseekV41Config":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents of a checkpoint of this model."""
        text = dataclasses.asdict(self)
        for key in ("max_backtracking", "swa_cache_format"):
            text.pop(key)
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "dtype": "bfloat16",
            "text_config": text,
            "quantization_config": {
                "quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
            },
        }
