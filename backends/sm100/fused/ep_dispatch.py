"""One-rank expert dispatch as a stable counting sort on the GPU, three Triton launches (one for at
most ``ONE_BLOCK_PAIRS`` pairs, whose placing programs count the keys themselves): each block
of ``BLOCK_PAIRS`` pairs (:func:`block_pairs`: a few rows for a small batch, so that no program
walks many in a row) histograms its keys (the expert id, ``E`` for an unrouted slot); a scan
over the blocks gives, per block and key, the pairs of that key in earlier blocks, and the key
totals (the group sizes); then each block walks its pairs ``ROWS`` at a time, places each at (pairs
with a smaller key) + (same key in earlier blocks) + (same key earlier in its block), writes the
handle's per-row fields there and copies the token's row of ``x``.

Keys live in ``BINS`` bins (a power of two above ``E + 1``); the last bin takes the lanes past the
pairs and is never read. The place kernel's second grid axis splits the hidden columns so that a
small batch still fills the GPU; only its first column split writes the handle's fields."""
from __future__ import annotations

import triton
import triton.language as tl

MAX_BLOCK_PAIRS = 256
TARGET_BLOCKS = 512
SCAN_ROWS = 128
SCAN_BINS = 32
BLOCK_H = 512
ONE_BLOCK_PAIRS = 64
"""Pairs up to which one launch sorts and places them all."""
SELECT_ELEMENTS = 4096
TARGET_PROGRAMS = 1024
"""The place kernel splits the hidden columns until about this many programs run (never below ``BLOCK_H``)."""


def bin_count(num_experts: int) -> int:
    """Bins for ``num_experts`` experts: a power of two (at least ``SCAN_BINS``) above the unrouted bin."""
    return max(SCAN_BINS, triton.next_power_of_2(num_experts + 2))


def place_rows(bins: int) -> int:
    """Pairs the place kernel matches against every bin at once: about ``SELECT_ELEMENTS`` compares, 2 to 16."""
    return max(2, min(16, SELECT_ELEMENTS // bins))


def block_pairs(pairs: int, rows: int) -> int:
    """Pairs per block: a power of two from ``rows`` to ``MAX_BLOCK_PAIRS``, about ``TARGET_BLOCKS`` blocks."""
    return min(MAX_BLOCK_PAIRS, max(rows, triton.next_power_of_2(triton.cdiv(pairs, TARGET_BLOCKS))))


def split_columns(hidden: int, blocks: int) -> int:
    """Columns per place program: whole ``BLOCK_H`` tiles, split until ``blocks`` times the splits
    reaches ``TARGET_PROGRAMS`` (or every split is one tile)."""
    tiles = max(1, triton.cdiv(hidden, BLOCK_H))
    splits = max(1, min(tiles, TARGET_PROGRAMS // blocks))
    return triton.cdiv(tiles, splits) * BLOCK_H


@triton.jit
def _keys(topk_ids, pair, live, num_experts, BINS: tl.constexpr):
    """Bin of each pair (its expert, ``num_experts`` when unrouted, ``BINS - 1`` past the pairs)
    and whether it is routed (an id outside ``[0, num_experts)`` counts as unrouted)."""
    expert = tl.load(topk_ids + pair, mask=live, other=-1)
    routed = (expert >= 0) & (expert < num_experts)
    return tl.where(live, tl.where(routed, expert, num_experts), BINS - 1).to(tl.int32), routed


@triton.jit
def dispatch_count_kernel(topk_ids, counts, pairs, num_experts, BLOCK_PAIRS: tl.constexpr, BINS: tl.constexpr):
    """``counts[b, key]``: pairs ``[BLOCK_PAIRS * b, BLOCK_PAIRS * (b + 1))`` per bin, ``b = pid``."""
    block = tl.program_id(0)
    pair = block * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    key, _ = _keys(topk_ids, pair, pair < pairs, num_experts, BINS)
    tl.store(counts + block.to(tl.int64) * BINS + tl.arange(0, BINS), tl.histogram(key, BINS))


@triton.jit
def dispatch_scan_kernel(counts, starts, totals, group_sizes, blocks, num_experts, BINS: tl.constexpr,
                         SCAN_ROWS: tl.constexpr, SCAN_BINS: tl.constexpr):
    """For bins ``[SCAN_BINS * pid, SCAN_BINS * (pid + 1))``: ``starts[b, key]`` the sum of
    ``counts[:b, key]``, ``totals[key]`` of all blocks, ``group_sizes[e]`` (int64) for experts."""
    bins = tl.program_id(0) * SCAN_BINS + tl.arange(0, SCAN_BINS)
    running = tl.zeros((SCAN_BINS,), tl.int32)
    for first in range(0, blocks, SCAN_ROWS):
        block = first + tl.arange(0, SCAN_ROWS)
        inside = (block < blocks)[:, None]
        at = block[:, None].to(tl.int64) * BINS + bins[None, :]
        tile = tl.load(counts + at, mask=inside, other=0)
        tl.store(starts + at, running[None, :] + tl.cumsum(tile, 0) - tile, mask=inside)
        running += tl.sum(tile, 0)
    tl.store(totals + bins, running)
    tl.store(group_sizes + bins, running.to(tl.int64), mask=bins < num_experts)


@triton.jit
def one_block_starts(topk_ids, group_sizes, pairs, num_experts, write_sizes, BLOCK_PAIRS: tl.constexpr,
                     BINS: tl.constexpr):
    """Every pair in one block: per bin, the pairs of smaller keys (the bin's first row), counted
    here; ``group_sizes`` written where ``write_sizes``."""
    bins = tl.arange(0, BINS)
    sizes = tl.zeros((BINS,), tl.int32)
    for chunk in range(0, pairs, BLOCK_PAIRS):
        pair = chunk + tl.arange(0, BLOCK_PAIRS)
        key, _ = _keys(topk_ids, pair, pair < pairs, num_experts, BINS)
        sizes += tl.histogram(key, BINS, mask=pair < pairs)
    if write_sizes:
        tl.store(group_sizes + bins, sizes.to(tl.int64), mask=bins < num_experts)
    return tl.cumsum(sizes, 0) - sizes


@triton.jit
def place_pairs(x, topk_ids, topk_weights, running, expanded, pair_index, pair_weights, routed, expert_order,
                row_of_pair, first, last, pairs, top_k, num_experts, hidden, x_stride, col_start, col_end,
                write_fields, ROWS: tl.constexpr, BINS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Pairs ``[first, last)`` to their sorted rows ``r`` (``running``: per bin, the next row), the
    columns ``[col_start, col_end)`` of ``x``'s token rows copied there; where ``write_fields``
    also ``pair_index[r]``, ``pair_weights[r]`` (float32), ``routed[r]`` (int8), ``expert_order[r]
    = r`` and ``row_of_pair[pair] = r``."""
    bins = tl.arange(0, BINS)
    lane = tl.arange(0, ROWS)
    earlier = lane[None, :] < lane[:, None]
    for chunk in range(first, last, ROWS):
        pair = chunk + lane
        live = pair < pairs
        key, is_routed = _keys(topk_ids, pair, live, num_experts, BINS)
        match = key[:, None] == bins[None, :]
        same_before = ((key[:, None] == key[None, :]) & earlier).to(tl.int32)
        row = (tl.sum(tl.where(match, running[None, :], 0), 1) + tl.sum(same_before, 1)).to(tl.int64)
        running += tl.sum(match.to(tl.int32), 0)
        if write_fields:
            weight = tl.load(topk_weights + pair, mask=live, other=0.0).to(tl.float32)
            tl.store(pair_index + row, pair.to(tl.int64), mask=live)
            tl.store(pair_weights + row, weight, mask=live)
            tl.store(routed + row, is_routed.to(tl.int8), mask=live)
            tl.store(expert_order + row, row, mask=live)
            tl.store(row_of_pair + pair, row, mask=live)
        source = x + (pair // top_k).to(tl.int64)[:, None] * x_stride
        target = expanded + row[:, None] * hidden
        for col in range(col_start, col_end, BLOCK_H):
            cols = col + tl.arange(0, BLOCK_H)
            copied = live[:, None] & (cols < col_end)[None, :]
            tl.store(target + cols[None, :], tl.load(source + cols[None, :], mask=copied), mask=copied)


@triton.jit
def dispatch_place_kernel(x, topk_ids, topk_weights, starts, totals, group_sizes, expanded, pair_index, pair_weights,
                          routed, expert_order, row_of_pair, pairs, top_k, num_experts, hidden, x_stride, split_cols,
                          BLOCK_PAIRS: tl.constexpr, ROWS: tl.constexpr, BINS: tl.constexpr, BLOCK_H: tl.constexpr,
                          ONE_BLOCK: tl.constexpr):
    """Pairs of block ``pid0`` go to their sorted rows (:func:`place_pairs`), the columns of split
    ``pid1`` (``split_cols`` wide) copied, split 0 writing the handle's fields. ``ONE_BLOCK``: every
    pair is in block 0 and each program counts the keys itself (no count and scan launches;
    ``starts`` and ``totals`` unread), program ``(0, 0)`` writing ``group_sizes``."""
    block, split = tl.program_id(0), tl.program_id(1)
    if ONE_BLOCK:
        running = one_block_starts(topk_ids, group_sizes, pairs, num_experts, split == 0, BLOCK_PAIRS, BINS)
    else:
        bins = tl.arange(0, BINS)
        sizes = tl.load(totals + bins)
        running = tl.load(starts + block.to(tl.int64) * BINS + bins) + tl.cumsum(sizes, 0) - sizes
    col_start = split * split_cols
    first = block * BLOCK_PAIRS
    last = pairs if ONE_BLOCK else tl.minimum(first + BLOCK_PAIRS, pairs)
    place_pairs(x, topk_ids, topk_weights, running, expanded, pair_index, pair_weights, routed, expert_order,
                row_of_pair, first, last, pairs, top_k, num_experts, hidden, x_stride, col_start,
                tl.minimum(col_start + split_cols, hidden), split == 0, ROWS, BINS, BLOCK_H)


def main() -> None:
    """Check the dispatch kernels against the OpSpec reference on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("ep_dispatch")


if __name__ == "__main__":
    main()
