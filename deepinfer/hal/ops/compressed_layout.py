"""Where a decode step's compressed keys live: each sequence's key rows in the paged cache, and
the row and position of the key each query token closes.

A sequence's compressed tokens (one per ``ratio`` tokens) are laid out in paged blocks of
``tokens_per_block`` rows: token ``i`` of sequence ``b`` sits at flat row
``block_tables[b, i // tokens_per_block] * tokens_per_block + i % tokens_per_block``. A sequence
holding ``context_lens[b]`` tokens has ``context_lens[b] // ratio`` compressed tokens. A query at
position ``p`` sees ``(p + 1) // ratio`` of them, and closes one (the one it completes) when
``(p + 1) % ratio == 0``."""
from __future__ import annotations

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks


def compressed_decode_layout(block_tables: torch.Tensor, context_lens: torch.Tensor, positions: torch.Tensor,
                             seq_of_token: torch.Tensor, ratio: int, tokens_per_block: int):
    """The compressed-key layout of a decode step, from ``block_tables`` (int64 ``[B, W]``),
    ``context_lens`` (int64 ``[B]``) and per query token ``positions`` and ``seq_of_token``
    (int64 ``[T]``). Returns ``(rows, visible, store_rows, key_positions)``:

    - ``rows`` int32 ``[B, W * tokens_per_block + 1]``: each sequence's compressed tokens' flat
      rows in order, ``-1`` from its ``context_lens[b] // ratio``-th on and in the last column
      (which index ``-1`` reaches modulo the width);
    - ``visible`` int64 ``[T]``: how many compressed tokens each query sees, ``(p + 1) // ratio``;
    - ``store_rows`` int64 ``[T]``: the flat row of the compressed token the query closes
      (index ``visible - 1``), ``-1`` where it closes none or the sequence does not hold it;
    - ``key_positions`` int64 ``[T]``: the position RoPE turns that key by: the closed group's
      first position ``(visible - 1) * ratio``, 0 where none is closed; for ``ratio`` 1 the
      query's own position ``visible - 1``."""
    check_layout_args(block_tables, context_lens, positions, seq_of_token, ratio, tokens_per_block)
    batch, width = block_tables.shape
    columns = torch.arange(width * tokens_per_block + 1, device=block_tables.device)
    block = (columns // tokens_per_block).clamp(max=max(width - 1, 0))
    rows = block_tables[:, block] * tokens_per_block + columns % tokens_per_block if width \
        else torch.zeros(batch, 1, dtype=torch.int64, device=block_tables.device)
    rows = rows.masked_fill(columns >= (context_lens // ratio)[:, None], -1)
    if value_checks() and bool((rows < -1).any()):
        raise ValueError("a compressed token falls in a block the block table does not hold; "
                         "allocate ceil(context_len / 128) blocks per sequence")
    visible = (positions + 1) // ratio
    index = visible - 1
    if ratio > 1:
        index = index.masked_fill(positions.remainder(ratio) != ratio - 1, -1)
    key_positions = (index * ratio).clamp(min=0) if ratio > 1 else index
    store_rows = rows[seq_of_token, index.remainder(rows.shape[1])]
    return rows.to(torch.int32), visible, store_rows, key_positions


def check_layout_args(block_tables, context_lens, positions, seq_of_token, ratio, tokens_per_block) -> None:
    for name, value, dims in (("block_tables", block_tables, 2), ("context_lens", context_lens, 1),
                              ("positions", positions, 1), ("seq_of_token", seq_of_token, 1)):
        if value.dtype != torch.int64 or value.dim() != dims:
            raise ValueError(f"{name} must be int64 with {dims} dims, got {value.dtype} {tuple(value.shape)}")
    if context_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"context_lens has {context_lens.shape[0]} entries for {block_tables.shape[0]} block tables")
    if positions.shape != seq_of_token.shape:
        raise ValueError(f"positions {tuple(positions.shape)} and seq_of_token {tuple(seq_of_token.shape)} differ")
    for name, value in (("ratio", ratio), ("tokens_per_block", tokens_per_block)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value_checks() and seq_of_token.numel() and not bool(
            ((seq_of_token >= 0) & (seq_of_token < block_tables.shape[0])).all()):
        raise ValueError(f"seq_of_token must index the {block_tables.shape[0]} sequences")


def _decode_case(batch: int, query_len: int, width: int, ratio: int, tokens_per_block: int, padded: int = 0):
    """``batch`` sequences of ``query_len`` decode tokens each, with random lengths that fit their
    tables (the last ``padded`` sequences are padding rows: length 0, a table of -1)."""
    def make(gen: torch.Generator, device: torch.device):
        capacity = width * tokens_per_block * ratio
        context_lens = torch.randint(query_len, capacity + 1, (batch,), generator=gen)
        tables = torch.randperm(4 * batch * width, generator=gen)[:batch * width].view(batch, width)
        held = -(-context_lens // (tokens_per_block * ratio))
        tables = tables.masked_fill(torch.arange(width) >= held[:, None], -1)
        if padded:
            context_lens[-padded:] = 0
            tables[-padded:] = -1
        seq = torch.arange(batch).repeat_interleave(query_len)
        positions = context_lens[seq] - query_len + torch.arange(query_len).repeat(batch)
        return {"block_tables": tables.to(device), "context_lens": context_lens.to(device),
                "positions": positions.to(device), "seq_of_token": seq.to(device), "ratio": ratio,
                "tokens_per_block": tokens_per_block}
    return make


register(OpSpec(
    name="compressed_decode_layout",
    activations=False,
    summary="each sequence's compressed key rows, and the row/position of the key each decode token closes",
    reference=compressed_decode_layout,
    cases=(
        OpCase("tiny_c1", _decode_case(3, 1, 4, 1, 4)),
        OpCase("tiny_c2", _decode_case(4, 1, 3, 2, 2, padded=1)),
        OpCase("tiny_c2_verify", _decode_case(3, 3, 3, 2, 2)),
        OpCase("v41_c2", _decode_case(64, 1, 64, 2, 64), "real"),
        OpCase("v41_c1_verify", _decode_case(16, 6, 32, 1, 128), "real"),
    ),
))
