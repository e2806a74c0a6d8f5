"""A decode step's compressed-key layout (HAL ``compressed_decode_layout``) in one Triton kernel
of integer arithmetic: programs ``(block, b)`` with ``b < B`` write columns of sequence ``b``'s
row table, programs ``(block, B)`` the per-token outputs."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_backends.sm100.fused.swa_indices import floor_mod

BLOCK = 1024
"""Table columns, or tokens, per program."""


@triton.jit
def _row(block_tables, table_stride, seq, column, count, width, tokens_per_block, live):
    """Flat row of compressed token ``column`` of sequence ``seq`` (``-1`` from ``count`` on)."""
    block = tl.minimum(column // tokens_per_block, width - 1)
    entry = tl.load(block_tables + seq * table_stride + tl.maximum(block, 0), mask=live & (block >= 0), other=0)
    return tl.where(column < count, entry * tokens_per_block + column % tokens_per_block, -1)


@triton.jit
def compressed_layout_kernel(block_tables, context_lens, positions, seq_of_token, rows, visible, store_rows,
                             key_positions, batch, tokens, width, table_stride, ratio, tokens_per_block,
                             BLOCK: tl.constexpr):
    """``rows int32 [batch, width * tokens_per_block + 1]`` and the int64 ``[tokens]`` vectors
    ``visible``, ``store_rows``, ``key_positions`` (see the HAL op)."""
    b = tl.program_id(1)
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    columns = width * tokens_per_block + 1
    if b < batch:
        live = lanes < columns
        held = tl.load(context_lens + b) // ratio
        value = _row(block_tables, table_stride, b.to(tl.int64), lanes.to(tl.int64), held, width,
                     tokens_per_block, live)
        tl.store(rows + b.to(tl.int64) * columns + lanes, value.to(tl.int32), mask=live)
    else:
        live = lanes < tokens
        position = tl.load(positions + lanes, mask=live, other=0)
        seq = tl.load(seq_of_token + lanes, mask=live, other=0)
        seen = (position + 1 - floor_mod(position + 1, ratio)) // ratio
        index = seen - 1
        if ratio > 1:
            index = tl.where(floor_mod(position, ratio) == ratio - 1, index, -1)
            key = tl.maximum(index * ratio, 0)
        else:
            key = index
        held_of_token = tl.load(context_lens + seq, mask=live, other=0) // ratio
        row = _row(block_tables, table_stride, seq, floor_mod(index, columns), held_of_token, width, tokens_per_block,
                   live)
        tl.store(visible + lanes, seen, mask=live)
        tl.store(store_rows + lanes, row, mask=live)
        tl.store(key_positions + lanes, key, mask=live)


def main() -> None:
    """Check the kernel against the OpSpec reference on this GPU (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("compressed_decode_layout")


if __name__ == "__main__":
    main()
