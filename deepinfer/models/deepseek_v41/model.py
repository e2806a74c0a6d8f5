"""DeepSeek-V4.1 causal LM, written only against the HAL op table."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.ops.rope import YarnScaling, rope_cos_sin, rope_inv_freq
from deepinfer.hal.registry import OpTable
from deepinfer.hal.spec import Tolerance
from deepinfer.models.deepseek_v41.attention import Attention
from deepinfer.models.deepseek_v41.cache import LayerCache, ModelCaches
from deepinfer.models.deepseek_v41.config import ROPE_DIM, DeepseekV41Config
from deepinfer.models.deepseek_v41.draft import DraftBlock, HyperHead
from deepinfer.models.deepseek_v41.mhc import HyperConnection, first_stream_mix
from deepinfer.models.deepseek_v41.moe import MoE
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.layers import Linear, RMSNorm


class Embedding(nn.Module):
    """Token embedding ``weight [vocab, hidden]``."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.weight.shape[0]):
            raise ValueError(f"token ids must be in [0, {self.weight.shape[0]}), got range "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return self.weight[ids]


class Block(nn.Module):
    """One backbone layer: attention and MoE sublayers, each wrapped by a hyper-connection."""

    def __init__(self, cfg: DeepseekV41Config, ratio: int, ops: OpTable, dtype: torch.dtype,
                 experts: int | None = None, top_k: int | None = None):
        super().__init__()
        self.ratio = ratio
        hc = dict(hidden=cfg.hidden_size, streams=cfg.hc_mult, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                  sinkhorn_iters=cfg.hc_sinkhorn_iters, ops=ops)
        self.hc_attn = HyperConnection(**hc)
        self.hc_ffn = HyperConnection(**hc)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.attn = Attention(cfg, ratio, ops, dtype)
        self.ffn = MoE(cfg.hidden_size, experts or cfg.n_routed_experts, top_k or cfg.num_experts_per_tok,
                       cfg.moe_intermediate_size, cfg.shared_width, cfg.routed_scaling_factor,
                       cfg.swiglu_limit, ops, dtype)

    def forward(self, residual, pre, ctx, cache, cos_sin, yoco):
        """Returns ``(trunk, pre mix for the next sublayer)``; ``yoco`` carries the shared hidden."""
        def attention(x):
            hidden = self.attn_norm(x)
            if yoco.starts_here:
                yoco.shared_hidden = hidden
            return self.attn(hidden, ctx, cache, cos_sin, kv_source=yoco.shared_hidden)

        residual, attn_pre = self.hc_attn.run(residual, pre, attention)
        next_pre = attn_pre if pre is not None else None
        residual, ffn_pre = self.hc_ffn.run(residual, next_pre, lambda x: self.ffn(self.ffn_norm(x)))
        return residual, (ffn_pre if pre is not None else None)


class _Yoco:
    """Per-forward YOCO state: the shared hidden, captured at the first consumer layer."""

    def __init__(self):
        self.shared_hidden = None
        self.starts_here = False


class DeepseekV41ForCausalLM(nn.Module):
    """The backbone plus DSpark draft blocks; ``forward`` returns float32 logits of the rows in
    ``ctx.logits_indices``. ``max_model_len`` bounds the precomputed RoPE tables."""

    def __init__(self, cfg: DeepseekV41Config, ops: OpTable, dtype: torch.dtype = torch.float32,
                 max_model_len: int = 4096):
        super().__init__()
        self.cfg, self.ops, self.max_model_len = cfg, ops, max_model_len
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Block(cfg, r, ops, dtype) for r in cfg.layer_ratios)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, ops, dtype)
        self.hc_head = None if cfg.hc_shifted else HyperHead(cfg, ops)
        self.mtp = nn.ModuleList(DraftBlock(cfg, ops, dtype) for _ in range(cfg.num_nextn_predict_layers))
        self.register_buffer("rope_swa", self._rope_table(compressed=False), persistent=False)
        self.register_buffer("rope_compressed", self._rope_table(compressed=True), persistent=False)

    def _rope_table(self, compressed: bool) -> torch.Tensor:
        cfg = self.cfg
        if not compressed:
            return rope_cos_sin(rope_inv_freq(cfg.rope_theta, ROPE_DIM), self.max_model_len)
        scaling = cfg.rope_scaling
        yarn = None if not scaling else YarnScaling(
            factor=scaling["factor"], original_max_position_embeddings=scaling["original_max_position_embeddings"],
            beta_fast=scaling.get("beta_fast", 32), beta_slow=scaling.get("beta_slow", 1))
        return rope_cos_sin(rope_inv_freq(cfg.compress_rope_theta, ROPE_DIM, yarn), self.max_model_len)

    def allocate_caches(self, num_blocks: int, num_state_slots: int) -> ModelCaches:
        """Caches for this model on its device."""
        return ModelCaches.allocate(self.cfg, num_blocks, num_state_slots, self.embed.weight.device)

    def forward(self, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        if ctx.num_tokens and int(ctx.positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(ctx.positions.max())} is beyond max_model_len {self.max_model_len}")
        streams = self.cfg.hc_mult
        x = self.embed(ctx.input_ids)
        residual = x.unsqueeze(1).expand(-1, streams, -1).contiguous()
        pre = first_stream_mix(ctx.num_tokens, streams, x.device) if self.cfg.hc_shifted else None
        yoco, features = _Yoco(), []
        for i, (layer, cache) in enumerate(zip(self.layers, caches.layers)):
            yoco.starts_here = i == self.cfg.n_prefill_layers
            if ctx.capture_draft_features and i in self.cfg.dspark_target_layer_ids:
                features.append(residual.mean(dim=1))
            cos_sin = self.rope_compressed if layer.ratio else self.rope_swa
            residual, pre = layer(residual, pre, ctx, cache, cos_sin, yoco)
        ctx.draft_features = torch.cat(features, dim=-1) if features else None
        residual = residual[ctx.logits_indices]
        if pre is None:
            pre = self.hc_head.weights(residual)
        else:
            pre = pre[ctx.logits_indices]
        hidden = self.norm(self.ops.mhc_pre(residual, pre))
        return self.head(hidden).float()




STEPWISE_TOLERANCE = Tolerance(atol=5e-4, rtol=5e-4)
"""How far float32 logits may move when the same tokens are computed in other batch shapes
(chunked prefill, step-by-step decode, other partners): accumulation order only."""
