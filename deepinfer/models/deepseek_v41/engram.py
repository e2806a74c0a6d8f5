"""Engram memory: n-gram hash tables read by a backbone layer and gated into its trunk.

Every token's last N compressed token ids (its own and the N - 1 before it in its sequence, the
pad token before the start) are hashed per Engram layer, n-gram order ``n = 2..N`` and head
(:func:`~deepinfer.hal.ops.engram_hash.engram_hash`); each hash picks a row of that head's table.
The rows, concatenated, are projected by ``wkv`` to a key per hyper-connection stream plus one
shared value, which :func:`~deepinfer.hal.ops.engram_gate.engram_gate` adds to each stream. The
injection happens after the previous sublayer's post mix and before the layer's attention pre mix.

The hash constants follow DeepInfer: layer ``l``'s multipliers are odd int64s drawn by
``numpy.random.default_rng(10007 * l)`` below ``int64 max / compressed vocab size``, and every
table size is a distinct prime >= ``engram_vocab_size``, handed out in config order (layer, then
order, then head), each head's the next prime not yet taken."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from deepinfer.hal.formats import Quantized, dequantize
from deepinfer.hal.registry import OpTable, OpUnavailableError
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.layers import Linear, quantized_operand, quantized_parameters

HASH_SEED = 0
LAYER_SEED_STRIDE = 10007
"""Layer ``l``'s multipliers come from ``numpy.random.default_rng(HASH_SEED + LAYER_SEED_STRIDE * l)``."""
ENGRAM_OPS = ("engram_hash", "engram_gate")
"""The HAL ops a model with Engram layers calls."""


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every ``n`` below 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in bases:
        return True
    if any(n % p == 0 for p in bases):
        return False
    odd, twos = n - 1, 0
    while odd % 2 == 0:
        odd, twos = odd // 2, twos + 1
    for base in bases:
        x = pow(base, odd, n)
        if x in (1, n - 1):
            continue
        for _ in range(twos - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_sizes(cfg: DeepseekV41Config) -> list[list[list[int]]]:
    """``[layer][order - 2][head]`` table sizes of the Engram layers in ``engram_layer_ids`` order:
    distinct primes >= ``engram_vocab_size``, each the smallest not yet taken."""
    taken: set[int] = set()
    sizes = []
    for _ in cfg.engram_layer_ids:
        per_order = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            candidate, heads = cfg.engram_vocab_size, []
            for _ in range(cfg.engram_n_heads):
                while not is_prime(candidate) or candidate in taken:
                    candidate += 1
                taken.add(candidate)
                heads.append(candidate)
            per_order.append(heads)
        sizes.append(per_order)
    return sizes


def hash_multipliers(layer_ids: list[int], order: int, compressed_size: int) -> np.ndarray:
    """int64 ``[len(layer_ids), order]``: odd multipliers below ``int64 max / compressed_size``
    (so a product with any compressed id fits in int64), seeded per layer."""
    bound = max(1, np.iinfo(np.int64).max // compressed_size // 2)
    rows = [np.random.default_rng(HASH_SEED + LAYER_SEED_STRIDE * layer).integers(0, bound, size=(order,),
                                                                                   dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return np.stack(rows)


def require_engram_ops(ops: OpTable, layers: list[int]) -> None:
    """Refuse, at build time, an op table without the Engram ops."""
    for op in ENGRAM_OPS:
        if ops.sources.get(op) == "unavailable":
            reason = ops.backend.unsupported_reasons().get(op, "not implemented")
            raise OpUnavailableError(
                f"Engram layers {layers} need HAL op {op!r}, which backend {ops.backend.name!r} lacks ({reason}); "
                f"run with backend=reference, or set backend.fallback=reference to run the reference "
                f"implementation of the ops it lacks")


class EngramIndex(nn.Module):
    """The table rows every Engram layer reads for each row of a step (:meth:`forward`), from the
    compressed vocabulary ``vocab`` and the hash constants of ``cfg``."""

    def __init__(self, cfg: DeepseekV41Config, vocab: CompressedVocab, ops: OpTable):
        super().__init__()
        vocab.check_covers(cfg.vocab_size, "the Engram compressed vocabulary")
        self.ops, self.order, self.pad_token = ops, cfg.engram_max_ngram_size, cfg.engram_pad_token_id
        multipliers = hash_multipliers(cfg.engram_layer_ids, self.order, vocab.size)
        self.register_buffer("vocab_map", torch.tensor(vocab.ids, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.from_numpy(multipliers), persistent=False)
        self.register_buffer("table_sizes", torch.tensor(table_sizes(cfg), dtype=torch.int64), persistent=False)

    def forward(self, ctx: ForwardContext, history: torch.Tensor) -> torch.Tensor:
        """int64 ``[T, L, (N - 1) * H]``: each row's table rows in each Engram layer. Reads the
        tokens before each sequence's first row from ``history`` and records this step's there
        (:func:`ngram_token_ids`)."""
        raw = ngram_token_ids(ctx, history, self.order, self.pad_token)
        return self.ops.engram_hash(self.vocab_map[raw], self.multipliers, self.table_sizes)


def ngram_token_ids(ctx: ForwardContext, history: torch.Tensor, order: int, pad_token: int) -> torch.Tensor:
    """int64 ``[T, order]``: each row's token id and the ``order - 1`` before it in its sequence
    (``pad_token`` before position 0); then records this step's tokens in ``history``.

    ``history``: int64 ``[num_state_slots, R + 1]``, position ``p`` of the sequence in a slot at
    column ``p % R``, column ``R`` a scratch column. Earlier tokens of this step come from
    ``ctx.input_ids``, older ones from ``history``. Each sequence records its rows at its last
    ``R`` positions, so after a verify step of ``k + 1`` rows the ``N - 1`` positions before any
    accepted length are still there when ``R >= k + N - 1``
    (:attr:`~deepinfer.models.deepseek_v41.config.DeepseekV41Config.engram_history_tokens`). Fixed
    shapes, nothing read on the host."""
    ring = history.shape[1] - 1
    rows = torch.arange(ctx.num_tokens, device=ctx.input_ids.device)
    columns = [ctx.input_ids]
    for back in range(1, order):
        earlier = ctx.positions - back
        in_step = ctx.input_ids[(rows - back).clamp(min=0)]
        recorded = history[ctx.slot_of_token, earlier.clamp(min=0) % ring]
        before_start = torch.full_like(earlier, pad_token)
        columns.append(torch.where(earlier >= ctx.chunk_start_of_token, in_step,
                                   torch.where(earlier >= 0, recorded, before_start)))
    ids = torch.stack(columns, dim=1)
    kept = ctx.positions >= ctx.context_lens[ctx.seq_of_token] - ring
    history[ctx.slot_of_token, torch.where(kept, ctx.positions % ring, ring)] = ctx.input_ids
    return ids


class EngramTable(nn.Module):
    """One layer's n-gram table ``weight [rows, head_dim]``: every head's table of every order,
    one after the other; after :meth:`hold_quantized` e4m3 with ``weight_scale`` (UE8M0 per 32
    values of a row), the official format."""

    def __init__(self, rows: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=dtype), requires_grad=False)
        self.register_parameter("weight_scale", None)

    def hold_quantized(self, fmt: str = "fp8") -> None:
        """Keep the table as e4m3 with a UE8M0 scale per 32 values (its checkpoint format)."""
        self.weight, self.weight_scale = quantized_parameters(self.weight, fmt)

    def forward(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[T, E * head_dim]`` in ``dtype``: the table rows ``rows [T, E]``, concatenated."""
        table = quantized_operand(self.weight, self.weight_scale)
        if isinstance(table, Quantized):
            picked = dequantize(Quantized(table.data[rows], table.scale[rows], table.fmt, table.block))
        else:
            picked = table[rows]
        return picked.to(dtype).flatten(1)


class Engram(nn.Module):
    """Engram of one backbone layer (official names ``engram.{q_weight, k_weight, embed.weight,
    wkv.weight}``): ``q_weight``, ``k_weight [hc, H]`` are the gate's RMSNorm weights of the
    streams and of the keys, ``embed`` the n-gram table, ``wkv`` the projection of the fetched
    rows to ``hc + 1`` vectors of ``H``. ``index``: the layer's place in ``engram_layer_ids``."""

    def __init__(self, cfg: DeepseekV41Config, index: int, rows: int, ops: OpTable, dtype: torch.dtype):
        super().__init__()
        hidden, streams = cfg.hidden_size, cfg.hc_mult
        self.index, self.ops, self.eps = index, ops, cfg.rms_norm_eps
        self.q_weight = nn.Parameter(torch.ones(streams, hidden, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(streams, hidden, dtype=dtype), requires_grad=False)
        self.embed = EngramTable(rows, cfg.engram_head_dim, dtype)
        self.wkv = Linear(cfg.engram_tables * cfg.engram_head_dim, (streams + 1) * hidden, ops, dtype)

    def forward(self, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The trunk ``residual [T, hc, H]`` with this layer's memory injected; ``rows [T, L, E]``
        from :class:`EngramIndex`."""
        memory = self.embed(rows[:, self.index], residual.dtype)
        kv = self.wkv(memory).view(residual.shape[0], residual.shape[1] + 1, residual.shape[2])
        return self.ops.engram_gate(residual, kv, self.q_weight, self.k_weight, self.eps)
