"""Engram n-gram hashing: the table row each token's n-grams select in each Engram layer.

For n-gram order ``n`` (2..N) the hash of a token is ``XOR_{i<n} ids[:, i] * multipliers[l, i]``
(int64 products, ``ids[:, i]`` the token ``i`` positions back), and head ``h``'s row is that
hash modulo the head's table size, plus the head's offset in the layer's table (the sizes of the
tables before it, order-major)."""
from __future__ import annotations

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register


def engram_hash(ngram_ids: torch.Tensor, multipliers: torch.Tensor, table_sizes: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, L, (N - 1) * H]``: the table rows of ``T`` tokens in ``L`` Engram layers.

    ``ngram_ids``: int64 ``[T, N]``, column ``i`` the (compressed) id of the token ``i`` positions
    before each row's (column 0 the row's own); ``multipliers``: int64 ``[L, N]`` (odd);
    ``table_sizes``: int64 ``[L, N - 1, H]``, the table size of each order ``n = 2..N`` and head.
    Row ``[t, l, (n - 2) * H + h]`` is ``(XOR_{i<n} ngram_ids[t, i] * multipliers[l, i]) mod
    table_sizes[l, n - 2, h]`` plus the sizes of the tables before ``(n, h)`` in layer ``l``."""
    _check(ngram_ids, multipliers, table_sizes)
    layers, orders, heads = table_sizes.shape
    products = ngram_ids[:, None, :] * multipliers[None, :, :]
    hashes, rows = products[:, :, 0], []
    for order in range(orders):
        hashes = hashes ^ products[:, :, order + 1]
        rows.append(torch.remainder(hashes[:, :, None], table_sizes[None, :, order, :]))
    flat_sizes = table_sizes.reshape(layers, orders * heads)
    offsets = torch.cumsum(flat_sizes, dim=1) - flat_sizes
    return torch.cat(rows, dim=2) + offsets[None]


def _check(ngram_ids: torch.Tensor, multipliers: torch.Tensor, table_sizes: torch.Tensor) -> None:
    for name, tensor, dims in (("ngram_ids", ngram_ids, 2), ("multipliers", multipliers, 2),
                               ("table_sizes", table_sizes, 3)):
        if tensor.dtype != torch.int64 or tensor.dim() != dims:
            raise ValueError(f"{name} must be int64 with {dims} dims, got {tensor.dtype} {tuple(tensor.shape)}")
    order = ngram_ids.shape[1]
    if order < 2 or multipliers.shape[1] != order or table_sizes.shape[:2] != (multipliers.shape[0], order - 1):
        raise ValueError(f"shapes disagree: ngram_ids {tuple(ngram_ids.shape)} (N >= 2 columns), multipliers "
                         f"{tuple(multipliers.shape)} ([L, N]), table_sizes {tuple(table_sizes.shape)} ([L, N - 1, H])")


def _case(tokens: int, order: int, layers: int, heads: int, vocab: int, table: int):
    def make(gen: torch.Generator, device: torch.device):
        bound = (2**63 - 1) // vocab // 2
        multipliers = torch.randint(0, bound, (layers, order), generator=gen) * 2 + 1
        sizes = table + torch.randint(0, table, (layers, order - 1, heads), generator=gen)
        return {"ngram_ids": torch.randint(0, vocab, (tokens, order), generator=gen).to(device),
                "multipliers": multipliers.to(device), "table_sizes": sizes.to(device)}
    return make


register(OpSpec(
    name="engram_hash",
    activations=False,
    summary="Engram n-gram hashing: multiply-XOR hash per order, modulo each head's table size, plus offsets",
    reference=engram_hash,
    cases=(
        OpCase("tiny", _case(17, 3, 2, 2, 300, 97)),
        OpCase("tiny_orders_4", _case(9, 4, 1, 3, 50, 13)),
        OpCase("large_prefill", _case(4096, 3, 2, 8, 129280, 1 << 20), "real"),
    ),
))
