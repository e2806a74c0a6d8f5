"""DeepSeek-V4.1 causal LM, written only against the HAL op table."""
from __future__ import annotations

import logging

import torch
from torch import nn

from deepinfer.hal.ops.rope import YarnScaling, rope_cos_sin, rope_inv_freq
from deepinfer.hal.ops.sampling import SEED_NAMESPACE_DRAFT
from deepinfer.hal.registry import OpTable
from deepinfer.hal.spec import Tolerance
from deepinfer.hal.value_checks import value_checks
from deepinfer.models.deepseek_v41.block import Block, YocoState
from deepinfer.models.deepseek_v41.bounded_replay import check_keep_tokens, enter_consumer_half
from deepinfer.models.deepseek_v41.cache import ModelCaches
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS, ROPE_DIM, DeepseekV41Config
from deepinfer.models.deepseek_v41.draft import DraftBlock, HyperHead
from deepinfer.models.deepseek_v41.engram import Engram, EngramIndex, require_engram_ops, table_sizes
from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
from deepinfer.models.deepseek_v41.mhc import first_stream_mix
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.interface import DraftProposal, DraftSampling
from deepinfer.models.layers import Linear, RMSNorm, stacked

log = logging.getLogger(__name__)


class Embedding(nn.Module):
    """Token embedding ``weight [vocab, hidden]``."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor, streams: int | None = None) -> torch.Tensor:
        """``[T, hidden]``, or with ``streams`` the embedding repeated over that many hyper-connection
        streams, ``[T, streams, hidden]``, in one gather of whole rows (``index_select``, which
        copies rows where advanced indexing would gather element by element)."""
        if value_checks() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.weight.shape[0]):
            raise ValueError(f"token ids must be in [0, {self.weight.shape[0]}), got range "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        if streams is None:
            return self.weight.index_select(0, ids.reshape(-1)).view(*ids.shape, self.weight.shape[1])
        rows = ids.reshape(-1, 1).expand(-1, streams).reshape(-1)
        return self.weight.index_select(0, rows).view(*ids.shape, streams, self.weight.shape[1])


class DeepseekV41ForCausalLM(nn.Module):
    """The backbone plus DSpark draft blocks; ``forward`` returns float32 logits of the rows in
    ``ctx.logits_indices``. It implements :class:`~deepinfer.models.interface.GenerativeModel`:
    ``max_model_len`` plus ``position_margin`` (room for speculative rows past the end) bounds
    the precomputed RoPE tables. A config with Engram layers needs ``engram_vocab``, the
    compressed vocabulary of the model's tokenizer (:mod:`~deepinfer.models.deepseek_v41.engram`)."""

    page_tokens = PAGE_TOKENS

    def __init__(self, cfg: DeepseekV41Config, ops: OpTable, dtype: torch.dtype = torch.float32,
                 max_model_len: int = 4096, engram_vocab: CompressedVocab | None = None):
        super().__init__()
        self.cfg, self.ops, self.max_model_len = cfg, ops, max_model_len
        self.vocab_size = cfg.vocab_size
        self.position_margin = 4 * cfg.max_backtracking
        self.max_draft_tokens = cfg.max_backtracking - 1 if cfg.num_nextn_predict_layers else 0
        self.draft_noise_token = cfg.dspark_noise_token_id if cfg.dspark_noise_token_id is not None \
            else cfg.vocab_size - 1
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Block(cfg, r, ops, dtype, layer=i) for i, r in enumerate(cfg.layer_ratios))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, ops, dtype)
        self.hc_head = None if cfg.hc_shifted else HyperHead(cfg, ops)
        drafts = cfg.num_nextn_predict_layers
        self.mtp = nn.ModuleList(DraftBlock(cfg, ops, dtype, first=i == 0, last=i == drafts - 1)
                                 for i in range(drafts))
        self.register_buffer("rope_swa", self._rope_table(compressed=False), persistent=False)
        self.register_buffer("rope_compressed", self._rope_table(compressed=True), persistent=False)
        self.register_buffer("first_pre", first_stream_mix(1, cfg.hc_mult, torch.device("cpu")), persistent=False)
        self.engram_vocab, self.engram_index = engram_vocab, None
        if cfg.engram_layer_ids:
            self._add_engram(engram_vocab, dtype)

    def _add_engram(self, vocab: CompressedVocab | None, dtype: torch.dtype) -> None:
        layers = self.cfg.engram_layer_ids
        if vocab is None:
            raise ValueError(f"Engram layers {layers} need the compressed vocabulary of the model's tokenizer: pass "
                             f"engram_vocab=CompressedVocab.from_tokenizer_file(<tokenizer.json>), or "
                             f"CompressedVocab.identity(vocab_size) for a model without a tokenizer")
        require_engram_ops(self.ops, layers)
        if vocab.size != self.cfg.engram_compressed_vocab_size:
            log.warning("the tokenizer's compressed vocabulary has %d ids, config.json says "
                        "engram_compressed_vocab_size=%d; hashing with %d, as DeepInfer does",
                        vocab.size, self.cfg.engram_compressed_vocab_size, vocab.size)
        self.engram_index = EngramIndex(self.cfg, vocab, self.ops)
        for index, (layer, sizes) in enumerate(zip(layers, table_sizes(self.cfg))):
            rows = sum(sum(heads) for heads in sizes)
            self.layers[layer].engram = Engram(self.cfg, index, rows, self.ops, dtype)

    def _rope_table(self, compressed: bool) -> torch.Tensor:
        cfg = self.cfg
        if not compressed:
            return rope_cos_sin(rope_inv_freq(cfg.rope_theta, ROPE_DIM), self.max_positions)
        scaling = cfg.rope_scaling
        yarn = None if not scaling else YarnScaling(
            factor=scaling["factor"], original_max_position_embeddings=scaling["original_max_position_embeddings"],
            beta_fast=scaling.get("beta_fast", 32), beta_slow=scaling.get("beta_slow", 1))
        return rope_cos_sin(rope_inv_freq(cfg.compress_rope_theta, ROPE_DIM, yarn), self.max_positions)

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover: ``max_model_len + position_margin``."""
        return self.max_model_len + self.position_margin

    def allocate_caches(self, num_blocks: int, num_state_slots: int) -> ModelCaches:
        """Caches for this model on its device."""
        return ModelCaches.allocate(self.cfg, num_blocks, num_state_slots, self.embed.weight.device)

    def cache_bytes(self, num_blocks: int, num_state_slots: int) -> int:
        """Bytes :meth:`allocate_caches` takes for these counts."""
        return (num_blocks * ModelCaches.bytes_per_block(self.cfg)
                + num_state_slots * ModelCaches.bytes_per_state_slot(self.cfg))

    def check_bounded_replay(self, keep_tokens: int) -> None:
        """Refuse a ``keep_tokens`` that cannot hold the consumer SWA ring (window + backtracking)."""
        check_keep_tokens(keep_tokens, self.cfg)

    def forward(self, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor:
        if value_checks() and ctx.num_tokens and int(ctx.positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(ctx.positions.max())} is beyond max_model_len {self.max_model_len} "
                             f"(plus the {self.position_margin} positions speculative rows may reach)")
        streams = self.cfg.hc_mult
        residual = self.embed(ctx.input_ids, streams)
        pre = self.first_pre.expand(ctx.num_tokens, streams) if self.cfg.hc_shifted else None
        # the first mix reads stream 0, the embedding itself; each layer takes its input normalised by its attn_norm
        x = self.layers[0].attn_norm(residual[:, 0]) if self.cfg.hc_shifted and self.layers[0].engram is None else None
        engram_rows = self._engram_rows(ctx, caches)
        yoco, features = YocoState(), []
        for i, (layer, cache) in enumerate(zip(self.layers, caches.layers)):
            if layer.engram is not None:  # between the previous layer's post mix (post_only) and this pre mix
                residual = layer.engram(residual, engram_rows)
            yoco.starts_here = i == self.cfg.n_prefill_layers
            if yoco.starts_here and (ctx.replay_start is not None or ctx.replay_compact):
                ctx, keep = enter_consumer_half(layer, residual, pre, ctx, yoco, x)
                residual, pre, x, features = keep(residual), keep(pre), keep(x), [keep(f) for f in features]
                engram_rows = keep(engram_rows)
            if ctx.write_draft_cache and i in self.cfg.dspark_target_layer_ids:
                features.append(residual.mean(dim=1))
            cos_sin = self.rope_compressed if layer.ratio else self.rope_swa
            next_norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            post_only = i + 1 < len(self.layers) and self.layers[i + 1].engram is not None
            residual, pre, x = layer(residual, pre, ctx, cache, cos_sin, yoco, x, next_norm=next_norm,
                                     post_only=post_only)
        if ctx.write_draft_cache:
            self._write_draft_main_keys(torch.cat(features, dim=-1), ctx, caches)
        if ctx.shard is not None:  # one context-parallel rank's rows: the head reads every rank's
            if x is None:
                x = self.norm(self.ops.mhc_pre(residual, self.hc_head.weights(residual)))
            (x,), ctx = ctx.shard.gather(x), ctx.shard.full
        if x is None:
            residual = residual if ctx.every_row_logits else residual[ctx.logits_indices]
            x = self.norm(self.ops.mhc_pre(residual, self.hc_head.weights(residual)))
        elif not ctx.every_row_logits:
            x = x[ctx.logits_indices]
        return self.logits(x)

    def _engram_rows(self, ctx: ForwardContext, caches: ModelCaches) -> torch.Tensor | None:
        """Each row's Engram table rows (:class:`~deepinfer.models.deepseek_v41.engram.EngramIndex`), or None."""
        if self.engram_index is None:
            return None
        if ctx.shard is not None:
            raise ValueError("Engram under context parallelism is not supported yet: its n-gram history needs every "
                             "row of the step (the distributed Engram belongs to the parallelism work)")
        return self.engram_index(ctx, caches.engram_history)

    def _write_draft_main_keys(self, features: torch.Tensor, ctx: ForwardContext, caches: ModelCaches) -> None:
        """Store every draft layer's main keys (from the mean-over-streams target features) in its
        own SWA ring at the target tokens' positions."""
        ring = self.cfg.swa_ring_size
        if not self.mtp:
            raise ValueError("write_draft_cache needs a model with DSpark draft layers (num_nextn_predict_layers > 0)")
        if ctx.shard is not None:
            (features,), ctx = ctx.shard.gather(features), ctx.shard.full
        recent = ctx.positions >= ctx.context_lens[ctx.seq_of_token] - ring
        slots = self.ops.swa_ring_slots(ctx.slot_of_token, ctx.positions, ring).masked_fill(~recent, -1)
        hidden = self.mtp[0].main_hidden(features)
        for block, cache in zip(self.mtp, caches.draft_layers):
            block.store_main_keys(hidden, ctx.positions, self.rope_swa, cache, slots)

    def draft_forward(self, ctx: ForwardContext, caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel DSpark pass over each sequence's block ``[golden, noise, ...]``.

        ``ctx`` is a decode context with ``draft_block`` set to the block length. Returns float32
        logits of every row (before the Markov correction) and the pre-norm hidden states that
        the confidence head reads."""
        if not ctx.draft_block or not ctx.decode:
            raise ValueError("draft_forward needs a decode ForwardContext with draft_block set")
        streams, last = self.cfg.hc_mult, self.mtp[-1]
        residual = self.embed(ctx.input_ids, streams)
        shifted = self.cfg.draft_hc_shifted
        pre = self.first_pre.expand(ctx.num_tokens, streams) if shifted else None
        x = self.mtp[0].attn_norm(residual[:, 0]) if shifted else None
        yoco = YocoState()
        for i, (block, cache) in enumerate(zip(self.mtp, caches.draft_layers)):
            next_norm = self.mtp[i + 1].attn_norm if i + 1 < len(self.mtp) else None
            residual, pre, x = block(residual, pre, ctx, cache, self.rope_swa, yoco, x, next_norm=next_norm)
        hidden = x if shifted else self.ops.mhc_pre(residual, last.hc_head.weights(residual))
        return self.logits(hidden, last.norm), hidden

    def logits(self, hidden: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """float32 logits of ``hidden [T, D]`` (normalised, or normalised by ``norm`` in the same
        ``stacked_linear`` as the LM head), its accumulator written unrounded (as DeepInfer's
        head GEMM writes float32 logits)."""
        return stacked(self.ops, hidden, [self.head], norm=norm, out_dtype=torch.float32)[0]

    def draft(self, ctx: ForwardContext, caches: ModelCaches, sampling: DraftSampling) -> DraftProposal:
        """DSpark drafts: one parallel :meth:`draft_forward`, then token by token the Markov
        (bigram) correction from the previous token, a draw in the draft seed namespace at the
        position the token would take, and the confidence head's estimate. Nothing is read on
        the host. A block starts at the token the step emitted (``ctx.chunk_start`` is its
        position: DeepInfer's ``base + last_valid_offset``, ``base`` the step's sample position),
        so step ``i`` draws at ``chunk_start + 1 + i``, DeepInfer's
        ``base + last_valid_offset + i + 1``."""
        logits, hidden = self.draft_forward(ctx, caches)
        batch, k = ctx.num_seqs, ctx.draft_block
        logits, hidden = logits.view(batch, k, -1), hidden.view(batch, k, -1)
        head = self.mtp[-1]
        previous = ctx.input_ids.view(batch, k)[:, 0]
        tokens, logprobs, confidences = [], [], []
        for i in range(k):
            embedded, correction = head.markov(previous)
            ids, step_logprobs = self.ops.sample(logits[:, i] + correction, sampling.temperature, sampling.top_p,
                                                 sampling.top_k, sampling.seeds, ctx.chunk_start + 1 + i,
                                                 namespace=SEED_NAMESPACE_DRAFT, filter_order=sampling.filter_order)
            temperature = sampling.confidence_temperature
            temperature = temperature[i] if isinstance(temperature, tuple) else temperature
            confidences.append(head.confidence(hidden[:, i], embedded, temperature))
            tokens.append(ids)
            logprobs.append(step_logprobs)
            previous = ids
        return DraftProposal(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), torch.stack(confidences, dim=1))


STEPWISE_TOLERANCE = Tolerance(atol=5e-4, rtol=5e-4)
"""How far float32 logits may move when the same tokens are computed in other batch shapes
(chunked prefill, step-by-step decode, other partners): accumulation order only."""
