"""The MoE gate and the one-rank dispatch of its picks in one Triton launch, for a decode step's
few pairs: every program computes the gate of every token (:func:`.moe_gate.gate_rows`), keeps
its picks in its own scratch row, then counts and places the pairs as the one-block dispatch
does (:func:`.ep_dispatch.one_block_starts`, :func:`.ep_dispatch.place_pairs`), copying the
hidden columns of its split; program 0 writes the gate's outputs and the handle's fields."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_backends.sm100.fused.ep_dispatch import one_block_starts, place_pairs
from deepinfer_backends.sm100.fused.moe_gate import gate_rows


@triton.jit
def moe_route_kernel(x, logits, bias, weights, ids, picked_ids, picked_weights, group_sizes, expanded, pair_index,
                     pair_weights, routed, expert_order, row_of_pair, tokens, experts, logits_stride, routed_scale,
                     hidden, x_stride, split_cols, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, GATE_T: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr,
                     BLOCK_PAIRS: tl.constexpr, ROWS: tl.constexpr, BINS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``pid`` (a split of ``split_cols`` hidden columns): the gate's ``ids`` and ``weights``
    ``[tokens, TOP_K]`` into its rows of ``picked_ids`` / ``picked_weights`` (``[programs, tokens *
    TOP_K]``; program 0 also into ``ids`` and ``weights``), then the dispatch of those pairs."""
    split = tl.program_id(0)
    pairs = tokens * TOP_K
    own_ids = picked_ids + split.to(tl.int64) * pairs
    own_weights = picked_weights + split.to(tl.int64) * pairs
    slot = tl.arange(0, K_PAD)
    for first in range(0, tokens, GATE_T):
        row = first + tl.arange(0, GATE_T)
        live = row < tokens
        chosen, share = gate_rows(logits, bias, row, live, experts, logits_stride, routed_scale, TOP_K, K_PAD,
                                  HAS_BIAS, BLOCK_E, LIBDEVICE)
        out = row.to(tl.int64)[:, None] * TOP_K + slot[None, :]
        stored = live[:, None] & (slot < TOP_K)[None, :]
        tl.store(own_ids + out, chosen, mask=stored)
        tl.store(own_weights + out, share, mask=stored)
        if split == 0:
            tl.store(ids + out, chosen, mask=stored)
            tl.store(weights + out, share, mask=stored)
    tl.debug_barrier()  # the picks, stored by some threads of this program, are read by others below
    running = one_block_starts(own_ids, group_sizes, pairs, experts, split == 0, BLOCK_PAIRS, BINS)
    col_start = split * split_cols
    place_pairs(x, own_ids, own_weights, running, expanded, pair_index, pair_weights, routed, expert_order,
                row_of_pair, 0, pairs, pairs, TOP_K, experts, hidden, x_stride, col_start,
                tl.minimum(col_start + split_cols, hidden), split == 0, ROWS, BINS, BLOCK_H)


def main() -> None:
    """Check the fused gate and dispatch against the OpSpec reference on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("moe_route")


if __name__ == "__main__":
    main()
