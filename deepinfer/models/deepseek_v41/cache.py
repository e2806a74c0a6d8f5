"""KV caches of a DeepSeek-V4.1 model: SWA rings and compress state per sequence slot, paged
compressed KV and index K per 128-token block."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.value_checks import value_checks
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS, DeepseekV41Config


@dataclass
class LayerCache:
    """One attention layer's caches (a layer that shares its compressed KV or index K with an
    earlier layer holds that layer's tensors, :attr:`DeepseekV41Config.layer_sources`).

    ``swa_ring``: uint8 ``[num_state_slots * ring_size, 528]`` (row ``slot * ring + p % ring``).
    ``compressed`` / ``index_k``: uint8 ``[num_blocks, PAGE_TOKENS // ratio, bytes]``.
    ``compress_state``: float32 ``[num_state_slots, ring, 2, 512]`` (C2 only)."""

    ratio: int
    swa_ring: torch.Tensor
    compressed: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    compress_state: torch.Tensor | None = None

    @property
    def tokens_per_block(self) -> int:
        return PAGE_TOKENS // self.ratio

    def compressed_slots(self, block_tables: torch.Tensor, seq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Flat rows of logical compressed tokens ``index`` of sequences ``seq`` (-1 stays -1)."""
        per_block = self.tokens_per_block
        valid = index >= 0
        safe = index.clamp(min=0)
        block = block_tables[seq, safe // per_block]
        rows = block * per_block + safe % per_block
        if value_checks() and bool((valid & (block < 0)).any()):
            raise ValueError("a compressed token falls in a block the block table does not hold; "
                             "allocate ceil(context_len / 128) blocks per sequence")
        return torch.where(valid, rows, torch.full_like(rows, -1))


@dataclass
class ModelCaches:
    """All layers' caches; allocate with :meth:`allocate`. ``engram_history`` (models with Engram
    layers): int64 ``[num_state_slots, cfg.engram_history_tokens + 1]``, each slot's recent token ids
    (:func:`~deepinfer.models.deepseek_v41.engram.ngram_token_ids`)."""

    layers: list[LayerCache]
    draft_layers: list[LayerCache]
    num_blocks: int
    num_state_slots: int
    engram_history: torch.Tensor | None = None

    @classmethod
    def allocate(cls, config: DeepseekV41Config, num_blocks: int, num_state_slots: int,
                 device: torch.device | str = "cpu") -> "ModelCaches":
        ring = config.swa_ring_size
        swa_bytes = token_format(config.swa_cache_format).bytes_per_token

        def layer(ratio: int) -> LayerCache:
            cache = LayerCache(ratio, torch.zeros(num_state_slots * ring, swa_bytes, dtype=torch.uint8, device=device))
            if ratio:
                per_block = PAGE_TOKENS // ratio
                kv_bytes = token_format(config.compressed_cache_format).bytes_per_token
                cache.compressed = torch.zeros(num_blocks, per_block, kv_bytes, dtype=torch.uint8, device=device)
                cache.index_k = torch.zeros(num_blocks, per_block, token_format("index_fp4").bytes_per_token,
                                            dtype=torch.uint8, device=device)
            if ratio > 1:
                cache.compress_state = torch.zeros(num_state_slots, config.compress_state_ring(ratio), 2,
                                                   config.head_dim, device=device)
            return cache

        layers, all_sources = [], config.layer_sources
        for i, ratio in enumerate(config.layer_ratios):
            sources = all_sources.get(i)
            if sources is None or not sources.shares(i):
                layers.append(layer(ratio))
                continue
            # a layer that shares reads (and, for the parts it owns, writes) its sources' tensors
            own = layer(0)
            own.ratio = ratio
            kv_source = layers[sources.kv]
            own.compressed = kv_source.compressed
            own.index_k = layers[sources.index_k].index_k if sources.index_k != i else \
                torch.zeros_like(kv_source.index_k)
            layers.append(own)
        return cls(
            layers=layers,
            draft_layers=[layer(0) for _ in range(config.num_nextn_predict_layers)],
            num_blocks=num_blocks,
            num_state_slots=num_state_slots,
            engram_history=torch.zeros(num_state_slots, config.engram_history_tokens + 1, dtype=torch.int64,
                                       device=device) if config.engram_layer_ids else None,
        )

    @staticmethod
    def bytes_per_block(config: DeepseekV41Config) -> int:
        """Paged bytes one 128-token block takes over all layers."""
        kv = token_format(config.compressed_cache_format).bytes_per_token
        idx = token_format("index_fp4").bytes_per_token
        sources = config.layer_sources
        return sum((PAGE_TOKENS // r) * (kv * (sources[i].kv == i) + idx * (sources[i].index_k == i))
                   for i, r in enumerate(config.layer_ratios) if r)

    @staticmethod
    def bytes_per_state_slot(config: DeepseekV41Config) -> int:
        """Bytes of one sequence's SWA rings, compress state and Engram history over all layers."""
        ring = config.swa_ring_size * token_format(config.swa_cache_format).bytes_per_token
        layers = config.num_hidden_layers + config.num_nextn_predict_layers
        sources = config.layer_sources
        state = sum(config.compress_state_ring(r) * 2 * config.head_dim * 4
                    for i, r in enumerate(config.layer_ratios) if r > 1 and sources[i].kv == i)
        engram = (config.engram_history_tokens + 1) * 8 if config.engram_layer_ids else 0
        return layers * ring + state + engram
