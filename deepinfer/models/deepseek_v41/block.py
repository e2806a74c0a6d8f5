"""One backbone layer (attention + MoE, each inside a hyper-connection) and the YOCO state."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.attention import Attention
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.mhc import HyperConnection
from deepinfer.models.deepseek_v41.moe import MoE
from deepinfer.models.layers import RMSNorm


class Block(nn.Module):
    """One backbone layer: attention and MoE sublayers, each wrapped by a hyper-connection."""

    def __init__(self, cfg: DeepseekV41Config, ratio: int, ops: OpTable, dtype: torch.dtype,
                 experts: int | None = None, top_k: int | None = None, layer: int | None = None):
        super().__init__()
        self.ratio = ratio
        hc = dict(hidden=cfg.hidden_size, streams=cfg.hc_mult, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                  sinkhorn_iters=cfg.hc_sinkhorn_iters, sinkhorn_order=cfg.hc_sinkhorn_order, ops=ops)
        self.hc_attn = HyperConnection(**hc)
        self.hc_ffn = HyperConnection(**hc)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.attn = Attention(cfg, ratio, ops, dtype, layer)
        self.ffn = MoE(cfg.hidden_size, experts or cfg.n_routed_experts, top_k or cfg.num_experts_per_tok,
                       cfg.moe_intermediate_size, cfg.shared_width, cfg.routed_scaling_factor,
                       cfg.swiglu_limit, ops, dtype)
        self.engram = None  # an Engram module on the layers of engram_layer_ids (set by the model)

    def forward(self, residual, pre, ctx, cache, cos_sin, yoco, x=None, next_norm=None, post_only=False):
        """Returns ``(trunk, pre mix for the next sublayer, its input)`` (:meth:`run`); ``yoco``
        carries the shared hidden. The sublayers are fed their inputs normalised (``attn_norm``,
        ``ffn_norm``); a given ``x`` comes normalised by ``attn_norm``, and under shifted HC the
        next input is returned normalised by ``next_norm`` (the next layer's ``attn_norm``, or the
        final norm), or raw when it is None, or not at all with ``post_only`` (the next layer
        changes the trunk first: Engram)."""
        def attention(x):
            if yoco.starts_here and yoco.shared_hidden is None:
                yoco.shared_hidden, yoco.shared_ctx = x, ctx
            return self.attn(x, ctx, cache, cos_sin, kv_source=yoco.shared_hidden, kv_ctx=yoco.shared_ctx,
                             shared=yoco.cross_layer)

        return self.run(residual, pre, attention, self.ffn, x, norms=(self.attn_norm, self.ffn_norm, next_norm),
                        post_only=post_only)

    def run(self, residual, pre, attention, ffn, x=None, norms=None, post_only=False):
        """The hyper-connection wiring around two sublayer callables (``[T, H] -> [T, H]``):
        ``attention`` and ``ffn``, fed the mixed input as it is, or with ``norms`` (``(attention
        norm, ffn norm, next input's norm or None)``) normalised by the first two (the ffn's input
        normalised in the attention's ``mhc_post_pre``). Returns ``(trunk, pre mix for the next
        sublayer, the next sublayer's input)``: under shifted HC (``pre`` given) the input comes
        with the trunk (``x`` is this layer's, when the previous layer gave it), else the mix and
        the input are None; ``post_only`` ends the ffn's step after its post mix (no next input).
        Shared by inference and training."""
        attn_norm, ffn_norm, next_norm = norms or (None, None, None)
        residual, attn_pre, x = self.hc_attn.run(residual, pre, attention, x, norm=attn_norm, next_norm=ffn_norm)
        next_pre = attn_pre if pre is not None else None
        residual, ffn_pre, x = self.hc_ffn.run(residual, next_pre, ffn, x, norm=ffn_norm, next_norm=next_norm,
                                               post_only=post_only)
        return residual, (ffn_pre if pre is not None else None), x


class YocoState:
    """Per-forward YOCO state: the shared hidden, captured at the first consumer layer (or
    before it, on the full token layout, by compact bounded replay), and the context of its rows;
    and what layers that share caches hand on (``cross_layer``: selected keys, keys before RoPE)."""

    def __init__(self):
        self.shared_hidden = None
        self.shared_ctx = None
        self.starts_here = False
        self.cross_layer = {}
