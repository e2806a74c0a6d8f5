"""DSpark draft blocks (``mtp.{i}``) and the HC head, with the official parameters.

The model runs the draft layers in one parallel pass (``DeepseekV41ForCausalLM.draft_forward``);
the sequential Markov-corrected sampling and verification live in ``deepinfer.decoding.dspark``."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.block import Block
from deepinfer.models.deepseek_v41.cache import LayerCache
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.layers import Linear, RMSNorm


class HyperHead(nn.Module):
    """HC head of non-shifted models: ``fn [hc, hc*H]``, ``base [hc]``, ``scale [1]``."""

    def __init__(self, cfg: DeepseekV41Config, ops: OpTable):
        super().__init__()
        hc = cfg.hc_mult
        self.fn = nn.Parameter(torch.zeros(hc, hc * cfg.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(hc), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.norm_eps, self.hc_eps, self.ops = cfg.rms_norm_eps, cfg.hc_eps, ops

    def weights(self, residual: torch.Tensor) -> torch.Tensor:
        """Per-stream read-out weights ``[T, hc]``."""
        return self.ops.mhc_head(residual, self.fn, self.scale, self.base, self.norm_eps, self.hc_eps)


class MarkovHead(nn.Module):
    """Low-rank bigram correction: ``logits += head.weight @ embed.weight[prev]``."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.empty(vocab, rank, dtype=dtype), requires_grad=False)
        self.head = nn.Module()
        self.head.weight = nn.Parameter(torch.empty(vocab, rank, dtype=dtype), requires_grad=False)


class ConfidenceHead(nn.Module):
    """``sigmoid(<[h ; markov embed], proj> / T)``: the chance a draft is accepted."""

    def __init__(self, hidden: int, rank: int, ops: OpTable, dtype: torch.dtype):
        super().__init__()
        self.proj = Linear(hidden + rank, 1, ops, dtype)


class DraftBlock(Block):
    """One DSpark draft layer: an SWA-only HC + MoE block (its own, possibly smaller MoE).

    As the official checkpoint lays them out, the first block (``first``) also holds the one
    projection of the target layers' features that every draft layer's main keys start from
    (``main_proj``, ``main_norm``), and the last block (``last``) the heads: Markov, confidence,
    the final norm and, for non-shifted draft blocks, the HC head."""

    def __init__(self, cfg: DeepseekV41Config, ops: OpTable, dtype: torch.dtype, first: bool = True,
                 last: bool = True):
        experts, top_k = cfg.draft_experts
        super().__init__(cfg, 0, ops, dtype, experts=experts, top_k=top_k)
        self.ops = ops
        if first:
            targets = max(1, len(cfg.dspark_target_layer_ids))
            self.main_proj = Linear(targets * cfg.hidden_size, cfg.hidden_size, ops, dtype)
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        if last:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
            self.confidence_head = ConfidenceHead(cfg.hidden_size, cfg.dspark_markov_rank, ops, dtype)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
            self.hc_head = None if cfg.draft_hc_shifted else HyperHead(cfg, ops)

    def main_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The first block's projection of the concatenated target features ``[T, n_targets*H]``:
        the hidden every draft layer's main keys are computed from."""
        return self.main_norm(self.main_proj(features))

    def main_keys(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """This layer's main-cache keys from :meth:`main_hidden` at ``positions`` (not stored)."""
        return self.ops.apply_rope(self.attn.kv_norm(self.attn.wkv(hidden)), positions, cos_sin)

    def store_main_keys(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                        cache: LayerCache, slots: torch.Tensor) -> None:
        """:meth:`main_keys`, fused with their store in this layer's SWA ring at flat ``slots``."""
        self.attn.swa_keys(self.attn.wkv(hidden), positions, cos_sin, cache, slots)

    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W1[previous], logit correction W2 @ W1[previous])`` of the bigram head."""
        embedded = self.markov_head.embed.weight[previous]
        return embedded, self.ops.linear(embedded, self.markov_head.head.weight, out_dtype=torch.float32)

    def confidence(self, hidden: torch.Tensor, embedded: torch.Tensor, temperature: float) -> torch.Tensor:
        """``sigmoid(<[h ; W1[prev]], w> / T)``: the estimated chance the draft is accepted."""
        score = self.confidence_head.proj(torch.cat((hidden, embedded.to(hidden.dtype)), dim=-1)).float()
        return torch.sigmoid(score.squeeze(-1) / temperature)
