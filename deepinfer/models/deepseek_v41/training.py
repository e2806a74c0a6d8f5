"""Differentiable full-sequence forward of a DeepSeek-V4.1 model and its DSpark draft blocks.

The inference forward reads and writes quantized paged caches; training needs one causal pass
over whole sequences with gradients. This module runs the *same* modules and weights through the
same HAL ops where they are differentiable (projections, norms, RoPE, C1/C2 compression, mHC,
MoE gate and experts, grouped output projection); only the cache plumbing is replaced:

* SWA keys are a dense band mask (query ``p`` sees keys ``p - window + 1 .. p``), compressed
  keys a dense mask by the inference rule (query ``p`` sees compressed ``0 .. (p+1)//ratio - 1``),
  and the sink is the same virtual zero-value key (``out * sigmoid(lse - sink)``).
* Keys are rounded to their cache formats (FP8 window, FP4/FP8 compressed) straight-through, so
  training sees what inference reads back.
* The sparse indexer is not run: :func:`check_training_length` requires ``index_topk`` to cover
  every compressed key at the training length, where top-k selects all of them and training
  equals inference. (Beyond that length the indexer, untrained, picks the keys.)

``checkpoint_rounded`` rounds the weights as the checkpoint stores them (FP8 / MXFP4 / bf16),
straight-through, for quantization-aware training."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.models.deepseek_v41.config import ATTENTION_DIM, DeepseekV41Config
from deepinfer.models.deepseek_v41.mhc import first_stream_mix
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import representable

_HC = re.compile(r"(hc_(?:attn|ffn|head))\.(fn|base|scale)$")
_STACKED_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")


def check_training_length(cfg: DeepseekV41Config, seq_len: int) -> None:
    """Raise ValueError unless a full-sequence pass of ``seq_len`` tokens equals inference."""
    sharing = {layer: s for layer, s in cfg.layer_sources.items() if s.shares(layer)}
    if sharing:
        raise ValueError(f"training a model whose layers share compressed caches ({sharing}) is not supported yet; "
                         f"train with every compressed layer its own source")
    if cfg.engram_layer_ids:
        raise ValueError(f"training a model with Engram layers ({cfg.engram_layer_ids}) is not supported yet; train "
                         f"with engram_layer_ids = []")
    ratios = [r for r in cfg.layer_ratios if r]
    most = max((seq_len // r for r in ratios), default=0)
    if cfg.index_topk < most:
        raise ValueError(f"index_topk={cfg.index_topk} is below the {most} compressed keys a query sees at "
                         f"training length {seq_len}; set index_topk >= {most} (top-k then keeps every key) "
                         f"or train on sequences of at most {cfg.index_topk * min(ratios)} tokens")
    if any(seq_len % r for r in ratios):
        raise ValueError(f"training length {seq_len} must be a multiple of every compression ratio "
                         f"{sorted(set(ratios))}")


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` in the forward pass, the identity in the backward pass."""
    return x + (rounded - x).detach()


def checkpoint_rounded(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """Every parameter (module names) rounded as the checkpoint stores it, straight-through; pass
    to :func:`torch.func.functional_call` for quantization-aware training."""
    out = {}
    for name, value in model.named_parameters():
        stacked = _STACKED_EXPERTS.match(name)
        official = f"{stacked.group(1)}.0.{stacked.group(2)}.weight" if stacked else _HC.sub(r"\1_\2", name)
        with torch.no_grad():
            rounded = representable(official, value.detach())
        out[name] = straight_through(value, rounded) if value.requires_grad else rounded
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Dense form of ``mla_sparse_prefill``: ``q [G, Q, h, D]`` over ``keys [G, S, D]`` (also the
    values) where ``visible`` (bool, broadcast to ``[G, Q, S]``) holds, plus the sink as a
    virtual zero-value key. Every query must see at least one key. Returns ``[G, Q, h, D]``."""
    logits = scale * torch.einsum("gqhd,gsd->gqhs", q.float(), keys.float())
    logits = logits.masked_fill(~visible.unsqueeze(-2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = torch.einsum("gqhs,gsd->gqhd", torch.exp(logits - lse), keys.float())
    return (out * torch.sigmoid(lse - sink.float()[:, None])).to(q.dtype)


@dataclass
class TargetPass:
    """Output of :meth:`TrainingForward.target`: ``logits [B, T, V]`` (float32), the DSpark
    target ``features [B, T, n_targets * H]`` (mean over HC streams at the target layers'
    attention input) and each MoE layer's expert ``ids`` (for the noaux_tc balancing step)."""

    logits: torch.Tensor
    features: torch.Tensor
    expert_ids: list[torch.Tensor]


class TrainingForward(nn.Module):
    """Full-sequence passes of ``model`` (held as ``self.model``) for training.

    ``round_kv``: round keys to their cache formats straight-through (default), so logits match
    the inference forward up to float accumulation order."""

    def __init__(self, model: DeepseekV41ForCausalLM, seq_len: int, round_kv: bool = True):
        super().__init__()
        check_training_length(model.cfg, seq_len)
        self.model, self.seq_len, self.round_kv = model, seq_len, round_kv

    def forward(self, ids: torch.Tensor, draft: tuple | None = None):
        """:meth:`target` of ``ids``, or with ``draft = (features, anchors, block, noise_id)``
        :meth:`draft` (one entry point, so :func:`torch.func.functional_call` can swap weights)."""
        return self.target(ids) if draft is None else self.draft(ids, *draft)

    def _round(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        if not self.round_kv:
            return x
        with torch.no_grad():
            rounded = self.model.ops.kv_cast(x.detach(), fmt).to(x.dtype)
        return straight_through(x, rounded)

    def target(self, ids: torch.Tensor) -> TargetPass:
        """Causal pass over ``ids [B, T]`` (``T <= seq_len``, a multiple of the ratios)."""
        model, cfg = self.model, self.model.cfg
        batch, length = ids.shape
        if length > self.seq_len:
            raise ValueError(f"sequences of {length} tokens exceed the checked training length {self.seq_len}")
        check_training_length(cfg, length)
        positions = torch.arange(length, device=ids.device).repeat(batch)
        x = model.embed(ids.reshape(-1))
        residual = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = first_stream_mix(x.shape[0], cfg.hc_mult, x.device) if cfg.hc_shifted else None
        x = x if cfg.hc_shifted else None  # the first mix reads stream 0: the embedding itself
        shared, features, expert_ids = None, [], []
        for i, layer in enumerate(model.layers):
            if i in cfg.dspark_target_layer_ids:
                features.append(residual.mean(dim=1))
            cos_sin = model.rope_compressed if layer.ratio else model.rope_swa
            consumer = i >= cfg.n_prefill_layers

            def attention(h, layer=layer, cos_sin=cos_sin, consumer=consumer):
                nonlocal shared
                hidden = layer.attn_norm(h)
                if consumer and shared is None:
                    shared = hidden
                return self._attention(layer.attn, hidden, shared, positions, batch, cos_sin)

            residual, pre, x = layer.run(residual, pre, attention, self._ffn(layer, expert_ids), x)
        if x is None:
            x = model.ops.mhc_pre(residual, model.hc_head.weights(residual))
        logits = model.head(model.norm(x)).float()
        feats = torch.cat(features, dim=-1).view(batch, length, -1) if features else logits.new_zeros(batch, length, 0)
        return TargetPass(logits.view(batch, length, -1), feats, expert_ids)

    @staticmethod
    def _ffn(layer, expert_ids: list):
        def ffn(h):
            x = layer.ffn_norm(h)
            weights, ids = layer.ffn.route(x)
            expert_ids.append(ids)
            return layer.ffn.apply_experts(x, weights, ids)
        return ffn

    def _attention(self, attn, hidden, kv_source, positions, batch, cos_sin):
        ops, cfg = attn.ops, attn.cfg
        tokens, length = hidden.shape[0], hidden.shape[0] // batch
        q_a = attn.q_norm(attn.wq_a(hidden))
        q = ops.apply_rope(attn.wq_b(q_a).view(tokens, attn.heads, ATTENTION_DIM), positions, cos_sin)
        kv = self._round(ops.apply_rope(attn.kv_norm(attn.wkv(hidden)), positions, cos_sin), cfg.swa_cache_format)
        query = torch.arange(length, device=hidden.device)
        visible = (query[None, :] <= query[:, None]) & (query[None, :] > query[:, None] - cfg.sliding_window)
        keys = [kv.view(batch, length, ATTENTION_DIM)]
        if attn.ratio:
            source = hidden if kv_source is None else kv_source
            keys.append(self._compressed(attn, source, positions, batch, cos_sin))
            compressed = torch.arange(length // attn.ratio, device=hidden.device)
            visible = torch.cat((visible, compressed[None, :] < ((query + 1) // attn.ratio)[:, None]), dim=1)
        out = attend(q.view(batch, length, attn.heads, ATTENTION_DIM), torch.cat(keys, dim=1), visible,
                     attn.attn_sink, attn.scale)
        out = ops.apply_rope(out.reshape(tokens, attn.heads, ATTENTION_DIM), positions, cos_sin, conjugate=True)
        return attn._project_out(out)

    def _compressed(self, attn, source, positions, batch, cos_sin):
        """Compressed keys ``[B, T // ratio, 512]`` as the cache holds them (post-RoPE, rounded)."""
        ops, comp, ratio = attn.ops, attn.compressor, attn.ratio
        latent = comp.wkv(source).float()
        score = comp.wgate(source).float() if comp.wgate is not None else None
        seq = torch.arange(batch, device=source.device).repeat_interleave(source.shape[0] // batch)
        state = latent.new_zeros(batch, ratio, 2, ATTENTION_DIM) if ratio > 1 else None
        packed, emit = ops.compress_tokens(latent, score, positions, seq, torch.zeros_like(positions), state, ratio)
        pre_rope = comp.norm(packed[emit].to(latent.dtype))
        key_pos = ((positions[emit] + 1) // ratio - 1) * ratio
        keys = self._round(ops.apply_rope(pre_rope, key_pos, cos_sin), attn.cfg.compressed_cache_format)
        return keys.view(batch, -1, ATTENTION_DIM)

    def draft(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, block: int,
              noise_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The DSpark draft pass for every anchor, as inference runs it.

        For anchor ``n`` (``anchors int64 [B, A]``, ``1 <= n <= T - block``) the block is
        ``[ids[n], noise x (block-1)]`` at positions ``n .. n+block-1``; each draft layer attends
        bidirectionally within the block and to its main keys (from ``features``) at positions
        ``n - window .. n - 1``. Returns float32 logits ``[B, A, block, V]`` (before the Markov
        correction) and the pre-norm hidden ``[B, A, block, H]`` the confidence head reads."""
        model, cfg = self.model, self.model.cfg
        batch, length = ids.shape
        count = anchors.shape[1]
        offsets = torch.arange(block, device=ids.device)
        positions = (anchors[..., None] + offsets).reshape(-1)
        tokens = torch.full((batch, count, block), noise_id, dtype=ids.dtype, device=ids.device)
        tokens[..., 0] = ids.gather(1, anchors)
        x = model.embed(tokens.reshape(-1))
        residual = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        flat_positions = torch.arange(length, device=ids.device).repeat(batch)
        window = cfg.sliding_window
        main_positions = anchors[..., None] - window + torch.arange(window, device=ids.device)
        main_visible = (main_positions >= 0).reshape(batch * count, 1, window)
        gather = (main_positions.clamp(min=0) + length * torch.arange(batch, device=ids.device)[:, None, None])
        block_visible = main_visible.new_ones(batch * count, 1, block)
        visible = torch.cat((main_visible, block_visible), dim=-1)
        main_hidden = model.mtp[0].main_hidden(features.reshape(batch * length, -1))
        shifted = cfg.draft_hc_shifted
        pre = first_stream_mix(x.shape[0], cfg.hc_mult, x.device) if shifted else None
        x = x if shifted else None  # the first shifted mix reads stream 0: the embedding itself
        for layer in model.mtp:
            main = self._round(layer.main_keys(main_hidden, flat_positions, model.rope_swa), cfg.swa_cache_format)
            main = main[gather.reshape(-1)].view(batch * count, window, ATTENTION_DIM)

            def attention(h, layer=layer, main=main):
                return self._draft_attention(layer.attn, layer.attn_norm(h), main, visible, positions, block)

            residual, pre, x = layer.run(residual, pre, attention, lambda h, layer=layer: layer.ffn(layer.ffn_norm(h)),
                                         x)
        last = model.mtp[-1]
        hidden = x if shifted else model.ops.mhc_pre(residual, last.hc_head.weights(residual))
        logits = model.head(last.norm(hidden)).float()
        return logits.view(batch, count, block, -1), hidden.view(batch, count, block, -1)

    def _draft_attention(self, attn, hidden, main, visible, positions, block):
        ops, cfg = attn.ops, attn.cfg
        tokens, cos_sin = hidden.shape[0], self.model.rope_swa
        q = ops.apply_rope(attn.wq_b(attn.q_norm(attn.wq_a(hidden))).view(tokens, attn.heads, ATTENTION_DIM),
                           positions, cos_sin)
        kv = self._round(ops.apply_rope(attn.kv_norm(attn.wkv(hidden)), positions, cos_sin), cfg.swa_cache_format)
        keys = torch.cat((main, kv.view(-1, block, ATTENTION_DIM)), dim=1)
        out = attend(q.view(-1, block, attn.heads, ATTENTION_DIM), keys, visible, attn.attn_sink, attn.scale)
        out = ops.apply_rope(out.reshape(tokens, attn.heads, ATTENTION_DIM), positions, cos_sin, conjugate=True)
        return attn._project_out(out)


def init_training_weights(model: DeepseekV41ForCausalLM, seed: int = 0) -> DeepseekV41ForCausalLM:
    """A starting point for training (not for inference tests: see ``init_random_weights``):
    unit norms, zero sinks and gate bias, fan-in scaled projections (output projections also
    scaled by depth), near-identity mHC stream mixing, zero Markov and confidence heads."""
    gen = torch.Generator().manual_seed(seed)
    depth = math.sqrt(2 * (model.cfg.num_hidden_layers + model.cfg.num_nextn_predict_layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape)
            elif leaf in ("attn_sink", "bias") or "confidence_head" in name or name.endswith("markov_head.head.weight"):
                value = torch.zeros(p.shape)
            elif ".hc_" in name:
                value = _hc_init(leaf, p.shape, noise, model.cfg.hc_mult)
            elif name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
                value = noise
            else:
                value = noise / math.sqrt(p.shape[-1])
                if name.endswith(("wo_b.weight", "ffn.experts.w2", "shared_experts.w2.weight")):
                    value = value / depth
            p.copy_(value.to(p.dtype))
    return model


def _hc_init(leaf: str, shape, noise: torch.Tensor, streams: int) -> torch.Tensor:
    if leaf == "fn":
        return 0.1 * noise / math.sqrt(shape[-1])
    if leaf == "scale":
        return torch.ones(shape)
    base = torch.zeros(shape)
    if shape[0] == streams * (2 + streams):
        base[2 * streams:] = 2.0 * torch.eye(streams).flatten()
    return base


def balance_gate_biases(moes, expert_ids: list[torch.Tensor], rate: float) -> None:
    """noaux_tc balancing step (no gradient): each gate's selection bias moves by ``rate``
    toward under-loaded experts (up where an expert got fewer tokens than the mean, down where
    it got more). ``moes`` and ``expert_ids`` pair each MoE with the ids it chose."""
    with torch.no_grad():
        for moe, ids in zip(moes, expert_ids):
            load = torch.bincount(ids.reshape(-1), minlength=moe.num_experts).float()
            moe.gate.bias += rate * torch.sign(load.mean() - load)


@dataclass
class DraftObjective:
    """The drafter's loss terms and acceptance statistics over a batch of blocks."""

    loss: torch.Tensor
    distill: torch.Tensor
    confidence_bce: torch.Tensor
    acceptance: torch.Tensor
    greedy_accepted_length: float


def draft_objective(model: DeepseekV41ForCausalLM, logits: torch.Tensor, hidden: torch.Tensor,
                    previous: torch.Tensor, target_logits: torch.Tensor,
                    distill_temperature: float = 1.0) -> DraftObjective:
    """Loss of draft rows ``[B, A, k, ...]`` against the target's distributions at the same
    positions (``target_logits [B, A, k, V]``, detached), teacher-forced: ``previous [B, A, k]``
    are the true tokens before each row (the golden token for row 0), which feed the Markov
    correction and the confidence head as at inference.

    ``distill``: cross-entropy of the Markov-corrected draft distribution ``p`` against the
    target distribution at ``distill_temperature`` (below 1 it leans toward the argmax, which
    is all greedy verification accepts); ``confidence_bce``: BCE of the confidence toward the exact
    acceptance probability ``sum_v min(p(v), q(v))``; ``acceptance [k]``: that probability per
    draft position; ``greedy_accepted_length``: mean accepted drafts per block under greedy
    verification (argmax p == argmax q, prefix-closed)."""
    head = model.mtp[-1]
    embedded, correction = head.markov(previous.reshape(-1))
    corrected = logits.reshape(-1, logits.shape[-1]) + correction
    log_p = torch.log_softmax(corrected, dim=-1)
    flat_target = target_logits.reshape(-1, target_logits.shape[-1]).float()
    q = torch.softmax(flat_target, dim=-1)
    q_distill = torch.softmax(flat_target / distill_temperature, dim=-1)
    distill = -(q_distill * log_p).sum(dim=-1).mean()
    accept = torch.minimum(log_p.detach().exp(), q).sum(dim=-1).clamp(0.0, 1.0)
    confidence = head.confidence(hidden.reshape(-1, hidden.shape[-1]), embedded, 1.0)
    bce = nn.functional.binary_cross_entropy(confidence.clamp(1e-6, 1 - 1e-6), accept)
    block = logits.shape[2]
    match = (corrected.argmax(-1) == q.argmax(-1)).view(-1, block).float()
    greedy = match.cumprod(dim=1).sum(dim=1).mean().item()
    return DraftObjective(distill + bce, distill.detach(), bce.detach(), accept.view(-1, block).mean(0), greedy)
