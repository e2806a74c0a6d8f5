"""V4.1 attention: MQA over a 512-dim K=V latent, SWA ring plus C1/C2 compressed keys chosen by
the sparse indexer, attention sink, conjugate RoPE on the output, grouped low-rank output."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.cache import LayerCache
from deepinfer.models.deepseek_v41.config import ATTENTION_DIM, INDEX_HEAD_DIM, DeepseekV41Config, LayerSources
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.layers import Linear, RMSNorm, stacked

INDEXER_GROUP_ELEMENTS = 1 << 26
"""Most ``rows x keys`` logits a prefill step's indexer scores at once (float32: 256 MiB)."""
INDEXER_GROUP_WASTE = 2
"""A run of sequences scores at most this many times the logits its rows need (each row needs its
own sequence's keys only), once it is past :data:`INDEXER_SMALL_GROUP`."""
INDEXER_SMALL_GROUP = 1 << 20
"""Runs up to this many logits group sequences whatever the waste (one launch beats several)."""


class Compressor(nn.Module):
    """Projects the compressed KV stream: ``wkv`` (latent) and, for C2, ``wgate`` (score)."""

    def __init__(self, cfg: DeepseekV41Config, ratio: int, ops: OpTable, dtype: torch.dtype):
        super().__init__()
        self.wkv = Linear(cfg.hidden_size, ATTENTION_DIM, ops, dtype)
        self.wgate = Linear(cfg.hidden_size, ATTENTION_DIM, ops, dtype) if ratio > 1 else None
        self.norm = RMSNorm(ATTENTION_DIM, cfg.rms_norm_eps, ops, dtype)


class Indexer(nn.Module):
    """Lightning-style indexer: index queries from ``q_a``, index keys from pre-RoPE compressed KV
    (``wk``, ``k_norm``: absent where the layer reads another layer's index keys).
    ``weight_scale`` (``(heads * 128) ** -0.5``) scales the head weights in float32, inside
    ``indexer_logits``."""

    def __init__(self, cfg: DeepseekV41Config, ops: OpTable, dtype: torch.dtype, keys: bool = True):
        super().__init__()
        self.heads = cfg.index_n_heads
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * INDEX_HEAD_DIM, ops, dtype)
        self.wk = Linear(ATTENTION_DIM, INDEX_HEAD_DIM, ops, dtype) if keys else None
        self.k_norm = RMSNorm(INDEX_HEAD_DIM, cfg.rms_norm_eps, ops, dtype) if keys else None
        self.weights_proj = Linear(cfg.hidden_size, self.heads, ops, dtype)
        self.weight_scale = (self.heads * INDEX_HEAD_DIM) ** -0.5


class Attention(nn.Module):
    """One layer's attention; ``ratio`` 0 is SWA only, 1 and 2 add compressed keys.

    A compressed layer ``layer`` may share with earlier layers (:attr:`DeepseekV41Config.layer_sources`):
    its compressed KV (then it has no compressor and stores none), its index keys (no ``wk`` or
    ``k_norm``) or its selected keys (no indexer). Values passed between the layers of one
    forward travel in its ``shared`` dict."""

    def __init__(self, cfg: DeepseekV41Config, ratio: int, ops: OpTable, dtype: torch.dtype = torch.float32,
                 layer: int | None = None):
        super().__init__()
        self.cfg, self.ratio, self.ops, self.layer = cfg, ratio, ops, layer
        self.sources = cfg.layer_sources.get(layer, LayerSources(layer, layer, layer)) if ratio else None
        self.heads = cfg.num_attention_heads
        heads_per_group = self.heads // cfg.o_groups
        self.attn_sink = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, ops, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, ops, dtype)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * ATTENTION_DIM, ops, dtype)
        self.wkv = Linear(cfg.hidden_size, ATTENTION_DIM, ops, dtype)
        self.kv_norm = RMSNorm(ATTENTION_DIM, cfg.rms_norm_eps, ops, dtype)
        self.wo_a = Linear(heads_per_group * ATTENTION_DIM, cfg.o_groups * cfg.o_lora_rank, ops, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, ops, dtype)
        self.compressor = Compressor(cfg, ratio, ops, dtype) if ratio and self.sources.kv == layer else None
        self.indexer = Indexer(cfg, ops, dtype, keys=self.sources.index_k == layer) \
            if ratio and self.sources.topk == layer else None
        self.scale = ATTENTION_DIM ** -0.5

    @property
    def shares(self) -> bool:
        """Whether this layer reads any cache or index of an earlier layer."""
        return self.sources is not None and self.sources.shares(self.layer)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, cache: LayerCache, cos_sin: torch.Tensor,
                kv_source: torch.Tensor | None = None, kv_ctx: ForwardContext | None = None,
                shared: dict | None = None) -> torch.Tensor:
        """``hidden`` is the normed layer input; compressed KV is projected from ``kv_source``
        (the YOCO shared hidden in consumer layers) when given, for every token of ``kv_ctx``
        (default ``ctx``; more rows than ``ctx`` under compact bounded replay). Consumer layers
        see SWA keys only from ``ctx.replay_start`` on, when it is set."""
        ops, pos = self.ops, ctx.positions
        if self.shares and shared is None:
            raise ValueError(f"layer {self.layer} shares caches with earlier layers ({self.sources}); pass the "
                             f"forward's shared dict")
        bounded = kv_source is not None and ctx.replay_start is not None
        visible = ctx.derived(("replay_visible",), lambda: ctx.replay_start[ctx.seq_of_token]) if bounded else None
        indexing = self.indexer is not None and (ctx.decode or not self._windows_fit_topk(ctx))
        compressing = self.compressor is not None and kv_source is None
        projected = self._project_hidden(hidden, indexing, compressing=compressing)
        q_weights, q_heads = ([self.wq_b, self.indexer.wq_b], [ATTENTION_DIM, INDEX_HEAD_DIM]) if indexing else \
            ([self.wq_b], [ATTENTION_DIM])
        # the indexer's queries leave cast through MXFP4, the format its scores read them in
        q_b = stacked(ops, projected["q_a"], q_weights, rope=(pos, cos_sin, q_heads), norm=self.q_norm,
                      mxfp4_products=(1,) if indexing else ())
        q = q_b[0].view(ctx.num_tokens, self.heads, ATTENTION_DIM)
        keys_ctx = ctx.shard.full if ctx.shard is not None else ctx
        written = self._whole_chunk(projected, ("kv", "latent", "score"), ctx)
        kv_latent = written["kv"]
        selected = None
        if self.ratio:
            if self.compressor is None:
                self._store_shared_index_keys(shared, ctx, cache, cos_sin)
            elif kv_source is None:
                self._store_compressed(written["latent"], written.get("score"), hidden, keys_ctx, cache, cos_sin,
                                       shared)
            else:
                self._project_and_store(kv_source, kv_ctx or ctx, cache, cos_sin, shared)
            if self.indexer is None:
                selected = shared[("selected", self.sources.topk)]
            else:
                selected = self._select_compressed(q_b[1] if indexing else None, projected.get("head_weights"), ctx,
                                                   cache, shared)
                if shared is not None:
                    shared[("selected", self.layer)] = selected
        attend = self._attend_decode if ctx.decode else self._attend_prefill
        out = attend(q, kv_latent, selected, ctx, cache, visible, cos_sin)
        return self._project_out(out, (pos, cos_sin))  # the output's inverse RoPE as wo_a reads it

    def _project_hidden(self, hidden: torch.Tensor, indexing: bool, compressing: bool) -> dict[str, torch.Tensor]:
        """The projections of ``hidden`` in one ``stacked_linear`` (DeepInfer's
        fused GEMMs): ``q_a`` and the SWA key ``kv``; ``head_weights`` (the indexer's) when
        ``indexing``; the compressor's ``latent`` (and, for C2, ``score``) when ``compressing``
        ``hidden`` itself."""
        named = {"q_a": self.wq_a, "kv": self.wkv}
        if indexing:
            named["head_weights"] = self.indexer.weights_proj
        if compressing:
            named["latent"] = self.compressor.wkv
            if self.compressor.wgate is not None:
                named["score"] = self.compressor.wgate
        return dict(zip(named, stacked(self.ops, hidden, list(named.values()))))

    @staticmethod
    def _whole_chunk(projected: dict[str, torch.Tensor], names: tuple[str, ...], ctx: ForwardContext):
        """``projected`` with its tensors ``names`` (those present) over every row of the step:
        under context parallelism (``ctx.shard``) every rank's rows gathered in one exchange, so
        each rank writes the whole chunk into its cache."""
        if ctx.shard is None:
            return projected
        present = [name for name in names if name in projected]
        return {**projected, **dict(zip(present, ctx.shard.gather(*(projected[n] for n in present))))}

    def _project_and_store(self, source, ctx, cache, cos_sin, shared=None) -> None:
        """Project ``source`` (another layer's hidden, with its own rows) through the compressor
        and store its keys (:meth:`_store_compressed`), over every row of the step."""
        comp = self.compressor
        weights = {"latent": comp.wkv, **({"score": comp.wgate} if comp.wgate is not None else {})}
        projected = self._whole_chunk(dict(zip(weights, stacked(self.ops, source, list(weights.values())))),
                                      tuple(weights), ctx)
        self._store_compressed(projected["latent"], projected.get("score"), source,
                               ctx.shard.full if ctx.shard is not None else ctx, cache, cos_sin, shared)

    def _store_compressed(self, latent, score, source, ctx, cache, cos_sin, shared=None) -> None:
        """Compress the tokens of ``source`` (projected to ``latent`` and, for C2, ``score``) and
        store the keys of the groups they close (every token gets a key row; the rows of tokens
        that close no group are not stored); the keys before RoPE go into ``shared`` for the
        layers that share this KV but project their own index keys from it."""
        ops, comp = self.ops, self.compressor
        keys, _ = ops.compress_tokens(latent, score, ctx.positions, ctx.slot_of_token,
                                      ctx.chunk_start_of_token, cache.compress_state, self.ratio)
        keys = keys.to(latent.dtype)  # bf16 values; a float32 model carries them in float32
        key_pos, slots = ctx.derived(("compressed_store", self.ratio), lambda: self._store_rows(ctx, cache))
        ops.kv_norm_rope_store(keys, comp.norm.weight, comp.norm.eps, key_pos, cos_sin, cache.compressed, slots,
                               self.cfg.compressed_cache_format)
        if shared is not None:
            shared[("pre_rope_kv", self.layer)] = (keys, comp.norm, source.dtype, ctx)
        self._store_index_keys(keys, comp.norm, source.dtype, key_pos, slots, cos_sin, cache)

    def _store_index_keys(self, keys, norm, dtype, key_pos, slots, cos_sin, cache) -> None:
        """The indexer's keys of the compressed ``keys`` (before RoPE), normed by the compressor's
        ``norm`` and projected in the activation ``dtype``, stored at ``slots``."""
        index_keys = stacked(self.ops, keys, [self.indexer.wk], norm=norm, dtype=dtype)[0]
        k_norm = self.indexer.k_norm
        self.ops.kv_norm_rope_store(index_keys, k_norm.weight, k_norm.eps, key_pos, cos_sin, cache.index_k, slots,
                                    "index_fp4")

    def _store_shared_index_keys(self, shared, ctx, cache, cos_sin) -> None:
        """A layer that reads another layer's compressed KV but owns its index keys projects them
        from that layer's keys of this forward."""
        if self.indexer is None or self.indexer.wk is None:
            return
        keys, norm, dtype, key_ctx = shared[("pre_rope_kv", self.sources.kv)]
        key_pos, slots = key_ctx.derived(("compressed_store", self.ratio), lambda: self._store_rows(key_ctx, cache))
        self._store_index_keys(keys, norm, dtype, key_pos, slots, cos_sin, cache)

    def _store_rows(self, ctx: ForwardContext, cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's compressed key position and cache row; ``-1`` where the token closes no
        group of ``ratio`` (``compress_tokens`` emits at ``(p + 1) % ratio == 0``). A decode step
        takes them from :meth:`_decode_layout`."""
        if ctx.decode:
            _, _, rows, key_pos = self._decode_layout(ctx, cache)
            return key_pos, rows
        index = self._visible(ctx) - 1
        if self.ratio > 1:
            index = index.masked_fill_(ctx.positions.remainder(self.ratio) != self.ratio - 1, -1)
        key_pos = (index * self.ratio).clamp_(min=0) if self.ratio > 1 else index
        return key_pos, cache.compressed_slots(ctx.block_tables, ctx.seq_of_token, index)

    def _visible(self, ctx: ForwardContext) -> torch.Tensor:
        """How many compressed keys each token sees, ``(p + 1) // ratio``; once per context and ratio."""
        return ctx.derived(("compressed_visible", self.ratio), lambda: (ctx.positions + 1) // self.ratio)

    def _decode_layout(self, ctx: ForwardContext, cache: LayerCache):
        """``compressed_decode_layout`` of a decode step, once per context and ratio: each
        sequence's key rows (int32 ``[B, keys + 1]``, ``-1`` past its count and in a last column,
        so no shape depends on the lengths), and per token the keys it sees, the row of the key
        it closes and that key's RoPE position."""
        return ctx.derived(("compressed_decode_layout", self.ratio), lambda: self.ops.compressed_decode_layout(
            ctx.block_tables, ctx.context_lens, ctx.positions, ctx.seq_of_token, self.ratio, cache.tokens_per_block))

    def swa_keys(self, latent: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, cache: LayerCache,
                 slots: torch.Tensor) -> torch.Tensor:
        """SWA keys of the projected ``latent`` (``kv_norm``, then RoPE at ``positions``) stored in
        the ring at flat ``slots`` (``-1``: not stored); returns them as a reader of the ring sees them."""
        return self.ops.kv_norm_rope_store(latent, self.kv_norm.weight, self.kv_norm.eps, positions, cos_sin,
                                           cache.swa_ring, slots, self.cfg.swa_cache_format)

    def _compressed_keys(self, ctx: ForwardContext, cache: LayerCache):
        """Flat cache rows of every sequence's compressed tokens (``-1``: none), and each
        sequence's first row among them. A decode step lays each sequence out in full
        (:meth:`_decode_layout`) and has no first rows (None); other steps pack the lengths the
        host knows. Computed once per context and ratio."""
        return ctx.derived(("compressed_keys", self.ratio), lambda: self._lay_out_compressed_keys(ctx, cache))

    def _lay_out_compressed_keys(self, ctx: ForwardContext, cache: LayerCache):
        if ctx.decode:
            return self._decode_layout(ctx, cache)[0].reshape(-1), None
        counts = ctx.context_lens // self.ratio
        total = sum(n // self.ratio for n in ctx.context_lens_host)
        seq = torch.repeat_interleave(torch.arange(ctx.num_seqs, device=counts.device), counts, output_size=total)
        first = torch.cat((counts.new_zeros(1), counts.cumsum(0)[:-1]))
        index = torch.arange(total, device=counts.device) - first[seq]
        return cache.compressed_slots(ctx.block_tables, seq, index), first

    def _candidates(self, logits, starts, visible, group: int, shared: dict | None) -> torch.Tensor:
        """``logits`` as the two-stage top-k leaves them: the candidate source layer keeps its own
        and puts its chosen blocks in ``shared``; a later layer scores only inside them."""
        source = self.cfg.candidate_source_layer_id
        if source is None or self.layer < source:
            return logits
        if shared is None:
            raise ValueError(f"layer {self.layer} selects inside layer {source}'s candidate blocks; pass the "
                             f"forward's shared dict")
        if self.layer == source:
            shared[("candidates", group)] = self.ops.candidate_blocks(
                logits, starts, visible, self.cfg.candidate_block_size, self.cfg.candidate_topk_blocks)
            return logits
        return logits.masked_fill(~shared[("candidates", group)], float("-inf"))

    def _select_compressed(self, index_q, head_weights, ctx, cache, shared=None) -> torch.Tensor:
        """The compressed keys each query attends to (-1 padding), from the indexer's queries
        ``index_q`` (RoPE applied) and ``head_weights``: offsets among its sequence's keys, or in a
        decode step their cache rows. A decode step scores each sequence's own keys only
        (per-sequence index keys). When no sequence of a prefill step holds more than
        ``index_topk`` compressed keys, the top-k of every query is its whole window, and the
        indexer is not run (``index_q`` is None)."""
        ops, idx = self.ops, self.indexer
        topk = self.cfg.index_topk
        if index_q is None:
            def whole_windows():
                offsets = torch.arange(topk, device=ctx.positions.device, dtype=torch.int32)
                return torch.where(offsets < self._visible(ctx)[:, None], offsets, -1)
            return ctx.derived(("whole_compressed_windows", self.ratio, topk), whole_windows)
        q = index_q.view(ctx.num_tokens, idx.heads, INDEX_HEAD_DIM)
        key_slots, first = self._compressed_keys(ctx, cache)
        if ctx.decode:
            keys = ops.kv_load(cache.index_k, key_slots, "index_fp4", dtype=q.dtype).view(ctx.num_seqs, -1,
                                                                                          INDEX_HEAD_DIM)
            visible = self._decode_layout(ctx, cache)[1]
            starts = ctx.derived(("zeros", visible.shape), lambda: torch.zeros_like(visible))
            logits = ops.indexer_logits(q, keys, head_weights, q_format=None, weight_scale=idx.weight_scale)
            logits = self._candidates(logits, starts, visible, 0, shared)
            return ops.indexer_topk(logits, starts, visible, topk, row_table=self._rows_of_token(ctx, cache))
        keys = ops.kv_load(cache.index_k, key_slots, "index_fp4")
        visible = self._visible(ctx)
        starts = first[ctx.seq_of_token]
        selected = []
        for group, (t0, t1, k0, k1) in enumerate(self._indexer_groups(ctx)):
            logits = ops.indexer_logits(q[t0:t1], keys[k0:k1], head_weights[t0:t1], q_format=None,
                                        weight_scale=idx.weight_scale)
            logits = self._candidates(logits, starts[t0:t1] - k0, visible[t0:t1], group, shared)
            selected.append(ops.indexer_topk(logits, starts[t0:t1] - k0, visible[t0:t1], topk))
        return torch.cat(selected)

    def _windows_fit_topk(self, ctx: ForwardContext) -> bool:
        """Whether every sequence of ``ctx`` holds at most ``index_topk`` compressed keys (host lengths)."""
        return max(ctx.context_lens_host, default=0) // self.ratio <= self.cfg.index_topk

    def _indexer_groups(self, ctx: ForwardContext) -> list[tuple[int, int, int, int]]:
        """Runs of consecutive sequences ``(first row, end row, first key, end key)`` whose dense
        ``rows x keys`` logits stay within :data:`INDEXER_GROUP_ELEMENTS` (a sequence alone may
        exceed it) and, past :data:`INDEXER_SMALL_GROUP`, within :data:`INDEXER_GROUP_WASTE` times
        the logits their rows need: a step of many sequences never scores every query against
        every sequence's keys. One run when the host does not know the query lengths."""
        if ctx.query_lens_host is None:
            return [(0, ctx.num_tokens, 0, sum(n // self.ratio for n in ctx.context_lens_host))]
        groups, t0, k0, t1, k1, needed = [], 0, 0, 0, 0, 0
        for rows, context in zip(ctx.query_lens_host, ctx.context_lens_host):
            keys = context // self.ratio
            dense = (t1 + rows - t0) * (k1 + keys - k0)
            wasteful = dense > INDEXER_SMALL_GROUP and dense > INDEXER_GROUP_WASTE * (needed + rows * keys)
            if t1 > t0 and (dense > INDEXER_GROUP_ELEMENTS or wasteful):
                groups.append((t0, t1, k0, k1))
                t0, k0, needed = t1, k1, 0
            t1, k1, needed = t1 + rows, k1 + keys, needed + rows * keys
        return groups + [(t0, t1, k0, k1)]

    def _attend_prefill(self, q, kv_latent, selected, ctx, cache, visible, cos_sin):
        """Prefill attention of ``ctx``'s queries over the SWA history, the step's keys
        (``kv_latent``, every row of the step; stored here) and the ``selected`` compressed keys."""
        ops, cfg = self.ops, self.cfg
        history_slots, slots, indices = self._swa_prefill_plan(ctx, visible is not None)
        history = ops.kv_load(cache.swa_ring, history_slots, cfg.swa_cache_format)
        keys_ctx = ctx.shard.full if ctx.shard is not None else ctx
        chunk = self.swa_keys(kv_latent, keys_ctx.positions, cos_sin, cache, slots)  # after the history is read
        buffers, main_keys = [history, chunk], None
        if selected is not None:
            key_slots, first = self._compressed_keys(ctx, cache)
            buffers.append(ops.kv_load(cache.compressed, key_slots, cfg.compressed_cache_format))
            base = ctx.derived(("compressed_base", self.ratio), lambda: (
                history.shape[0] + chunk.shape[0] + first[ctx.seq_of_token]).unsqueeze(1).to(selected.dtype))
            shifted = torch.where(selected >= 0, selected + base, selected)
            main_keys = indices.shape[1]
            indices = torch.cat((indices, shifted.to(indices.dtype)), dim=1)
        out, _ = ops.mla_sparse_prefill(q, torch.cat(buffers).to(q.dtype), indices, self.attn_sink, self.scale,
                                        main_keys=main_keys)
        return out

    def _swa_prefill_plan(self, ctx: ForwardContext, bounded: bool):
        """:meth:`_swa_prefill_layout` of the whole step, its windows cut to ``ctx``'s rows under
        context parallelism; ``bounded``: under bounded replay. Once per context."""
        cfg = self.cfg
        key = ("swa_prefill", cfg.sliding_window, cfg.swa_ring_size, bounded)

        def lay_out(whole: ForwardContext):
            visible = whole.derived(("replay_visible",), lambda: whole.replay_start[whole.seq_of_token]) \
                if bounded else None
            return self._swa_prefill_layout(whole, visible)
        if ctx.shard is None:
            return ctx.derived(key, lambda: lay_out(ctx))

        def cut():
            history_slots, slots, indices = ctx.shard.full.derived(key, lambda: lay_out(ctx.shard.full))
            return history_slots, slots, indices[ctx.shard.rows]
        return ctx.derived(key, cut)

    def _swa_prefill_layout(self, ctx: ForwardContext, visible: torch.Tensor | None):
        """The SWA side of a prefill step, the same in every layer: the flat ring rows of each
        sequence's history, each token's ring slot (``-1``: not stored; only the ring's recent
        tokens are, and after the history is read, which they may overwrite) and each token's
        window as indices into ``[history; chunk]``. Computed once per context."""
        ops, cfg = self.ops, self.cfg
        window, ring = cfg.sliding_window, cfg.swa_ring_size
        history_slots = ops.swa_history_slots(ctx.state_slots, ctx.chunk_start, window, ring).flatten()
        seq = ctx.seq_of_token
        recent = ctx.positions >= (ctx.context_lens[seq] - ring)
        slots = ops.swa_ring_slots(ctx.slot_of_token, ctx.positions, ring).masked_fill(~recent, -1)
        indices = ops.swa_prefill_indices(ctx.positions, ctx.chunk_start_of_token, seq * (window - 1),
                                          history_slots.shape[0] + ctx.query_start[seq], window, visible)
        return history_slots, slots, indices

    def _attend_decode(self, q, kv_latent, selected, ctx, cache, visible, cos_sin):
        ops, cfg = self.ops, self.cfg
        ring, fmt = cfg.swa_ring_size, cfg.swa_cache_format
        slots = ctx.derived(("swa_ring_slots", ring),
                            lambda: ops.swa_ring_slots(ctx.slot_of_token, ctx.positions, ring))
        self.swa_keys(kv_latent, ctx.positions, cos_sin, cache, slots)
        batch, s_q = ctx.num_seqs, ctx.decode_query_len
        main = ctx.derived(("swa_decode_indices", cfg.sliding_window, ring, visible is not None),
                           lambda: self._swa_decode_indices(ctx, visible))
        extra = {}
        if selected is not None:
            extra = dict(extra_cache=cache.compressed, extra_indices=selected.view(batch, s_q, -1),
                         extra_format=cfg.compressed_cache_format)
        out, _ = ops.mla_sparse_decode(q.view(batch, s_q, self.heads, ATTENTION_DIM), cache.swa_ring,
                                       main.view(batch, s_q, -1), self.attn_sink, self.scale,
                                       cache_format=fmt, **extra)
        return out.reshape(ctx.num_tokens, self.heads, ATTENTION_DIM)

    def _rows_of_token(self, ctx: ForwardContext, cache: LayerCache) -> torch.Tensor:
        """int32 ``[T, keys + 1]``: the key rows (:meth:`_decode_layout`) of each decode token's
        sequence. Computed once per context and ratio."""
        def lay_out():
            rows = self._decode_layout(ctx, cache)[0]
            return rows if ctx.decode_query_len == 1 else rows[ctx.seq_of_token]
        return ctx.derived(("compressed_rows_of_token", self.ratio), lay_out)

    def _swa_decode_indices(self, ctx: ForwardContext, visible: torch.Tensor | None) -> torch.Tensor:
        """The ring rows each decode query attends to (a draft block sees its whole block too)."""
        ops, cfg = self.ops, self.cfg
        if ctx.draft_block:
            key_end = ctx.context_lens[ctx.seq_of_token] - 1
            return ops.swa_decode_indices(ctx.slot_of_token, key_end, cfg.sliding_window + ctx.draft_block,
                                          cfg.swa_ring_size)
        return ops.swa_decode_indices(ctx.slot_of_token, ctx.positions, cfg.sliding_window, cfg.swa_ring_size,
                                      visible)

    def _project_out(self, out: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """Grouped low-rank projection: each group of heads to ``o_lora_rank``, then to hidden;
        ``rope`` (``(positions, cos_sin)``) turns the heads back first (conjugate RoPE), in
        ``out`` itself (nothing reads it afterwards)."""
        tokens, groups = out.shape[0], self.cfg.o_groups
        turn = {} if rope is None else dict(positions=rope[0], cos_sin=rope[1], rope_head=ATTENTION_DIM,
                                            conjugate=True, rope_in_place=True)
        low_rank = self.ops.grouped_linear(out.reshape(tokens, groups, -1), self.wo_a.operand(groups), **turn)
        return self.wo_b(low_rank.reshape(tokens, -1).to(out.dtype))
