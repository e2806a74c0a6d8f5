"""Per-row top-k of a column window in one Triton kernel: a radix select on an order-preserving
32-bit key of each logit finds the k-th largest key and how many columns equal to it are kept (the
lowest ones), and the chosen offsets are written in column order.

Each program takes rows ``pid, pid + programs, ...``. For a window of more than ``k`` columns:

1. one pass keeps, for each of ``BLOCK`` residues of the column, the largest key seen; the
   ``k``-th largest of those ``BLOCK`` maxima (two 8-bit radix digits, in registers) bounds the
   row's ``k``-th key from below, since each maximum is a distinct column;
2. one pass copies the columns at or above that bound, in order, to the program's scratch row
   (a block-wise ``tl.cumsum`` gives each its slot);
3. when at most ``CANDIDATES`` were copied, the exact select (four 8-bit digits, ``tl.histogram``)
   and the ordered write (one packed ``tl.cumsum`` gives each kept column its output slot) run on
   them in registers; otherwise the select runs over the whole row, one pass per digit, and a last
   pass writes.

A window of at most ``k`` columns is written as ``0 .. length - 1`` without reading the logits;
slots past ``min(length, k)`` get -1."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 4096
CANDIDATES = 4096
RADIX_BITS = 8
NUM_WARPS = 8
PROGRAMS_PER_SM = 2


@triton.jit
def _order_key(x):
    """The float32 ``x`` as a uint32 whose unsigned order is the float order (-0.0 ranks as +0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where(bits >= 0x80000000, ~bits, bits | 0x80000000)


@triton.jit
def _load_keys(row_logits, offset, lead, span, readable, BLOCK: tl.constexpr):
    """Keys of the ``BLOCK`` elements ``offset ..`` past ``row_logits`` (16-byte aligned, the window
    starting ``lead`` elements in and ending ``span`` in), whether each lies in the window, and its
    offset in the window; loads stop at ``readable``."""
    index = tl.multiple_of(offset, 4) + tl.arange(0, BLOCK)
    key = _order_key(tl.load(row_logits + index, mask=index < readable, other=0.0).to(tl.float32))
    return key, (index >= lead) & (index < span), index - lead


@triton.jit
def _narrow(counts, prefix, prefix_mask, needed, SHIFT: tl.constexpr, BINS: tl.constexpr):
    """Fix the digit at ``SHIFT`` of the ``needed``-th largest of the keys ``counts`` histograms
    (those matching ``prefix`` under ``prefix_mask``): the new prefix and mask, how many keys of
    the new prefix are still needed, and whether more of them than that share it."""
    bins = tl.arange(0, BINS)
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    boundary = tl.max(tl.where(at_or_above >= needed, bins, -1), 0)
    needed -= tl.sum(tl.where(bins > boundary, counts, 0), 0)
    unresolved = tl.sum(tl.where(bins == boundary, counts, 0), 0) > needed
    prefix = prefix | (boundary.to(tl.uint32) << SHIFT)
    prefix_mask = prefix_mask | (tl.full((), BINS - 1, tl.uint32) << SHIFT)
    return prefix, prefix_mask, needed, unresolved


@triton.jit
def _digits(keys, valid, prefix, prefix_mask, SHIFT: tl.constexpr, BINS: tl.constexpr):
    """Histogram of the digit at ``SHIFT`` of the valid keys that match ``prefix``."""
    matching = valid & ((keys & prefix_mask) == prefix)
    return tl.histogram(((keys >> SHIFT) & (BINS - 1)).to(tl.int32), BINS, mask=matching)


@triton.jit
def _select_in_registers(keys, valid, needed, DIGITS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The top ``DIGITS`` digits of the ``needed``-th largest valid key (prefix, mask) and how many
    keys of that prefix are kept."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    prefix = tl.full((), 0, tl.uint32)
    prefix_mask = tl.full((), 0, tl.uint32)
    unresolved = needed > 0
    for digit in tl.static_range(DIGITS):
        if unresolved:
            SHIFT: tl.constexpr = 32 - RADIX_BITS * (digit + 1)
            counts = _digits(keys, valid, prefix, prefix_mask, SHIFT, BINS)
            prefix, prefix_mask, needed, unresolved = _narrow(counts, prefix, prefix_mask, needed, SHIFT, BINS)
    return prefix, prefix_mask, needed


@triton.jit
def _mapped(row_rows, columns, live, HAS_TABLE: tl.constexpr):
    """``columns`` as written: the row table's entries at them with ``HAS_TABLE``, ``-1`` staying."""
    if HAS_TABLE:
        return tl.where(columns >= 0, tl.load(row_rows + tl.maximum(columns, 0), mask=live & (columns >= 0),
                                              other=-1), -1)
    return columns


@triton.jit
def _write_kept(row_out, row_rows, keys, valid, columns, prefix, prefix_mask, needed, above_before, ties_before,
                HAS_TABLE: tl.constexpr):
    """Store the columns of a block that are kept (keys above ``prefix`` under ``prefix_mask``, and
    the first ``needed`` of the row's keys equal to it) at their slots in column order (through
    the row's table with ``HAS_TABLE``); returns the running counts of keys above and equal."""
    masked = keys & prefix_mask
    above = (valid & (masked > prefix)).to(tl.int32)
    tie = (valid & (masked == prefix)).to(tl.int32)
    packed = above + (tie << 16)
    before = tl.cumsum(packed, 0) - packed
    tie_rank = ties_before + (before >> 16)
    keep = (above != 0) | ((tie != 0) & (tie_rank < needed))
    slot = above_before + (before & 0xFFFF) + tl.minimum(tie_rank, needed)
    tl.store(row_out + slot, _mapped(row_rows, columns, keep, HAS_TABLE), mask=keep)
    return above_before + tl.sum(above, 0), ties_before + tl.sum(tie, 0)


@triton.jit
def indexer_topk_kernel(logits, starts, lengths, out, scratch, row_table, tokens, row_stride, table_stride, extent,
                        k, HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr, CANDIDATES: tl.constexpr,
                        RADIX_BITS: tl.constexpr):
    """Rows ``pid, pid + programs, ..`` of ``logits``: ``out[row, :k]`` gets the offsets (from
    ``starts[row]``) of the ``k`` largest of the ``lengths[row]`` window logits, ties to the lower
    column, ascending, then -1; with ``HAS_TABLE`` each offset ``o`` as ``row_table[row, o]``
    (rows ``table_stride`` apart). ``extent``: elements readable from ``logits``; ``scratch``:
    int32 ``[programs, 2, CANDIDATES]``, this program's candidate keys and offsets."""
    tl.static_assert(32 % RADIX_BITS == 0)
    tl.static_assert(BLOCK < 65536 and CANDIDATES < 65536)
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = 32 // RADIX_BITS
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    candidate_keys = scratch + pid * (2 * CANDIDATES)
    candidate_columns = candidate_keys + CANDIDATES
    for row in range(pid, tokens, tl.num_programs(0)):
        length = tl.load(lengths + row).to(tl.int32)
        row_out = out + (row + tl.zeros((), tl.int64)) * k
        row_rows = row_table + (row + tl.zeros((), tl.int64)) * table_stride
        if length <= k:
            for offset in range(0, k, BLOCK):
                slot = offset + cols
                tl.store(row_out + slot, _mapped(row_rows, tl.where(slot < length, slot, -1), slot < k, HAS_TABLE),
                         mask=slot < k)
        else:
            first = tl.load(starts + row) + row_stride * (row + tl.zeros((), tl.int64))
            aligned = first // 4 * 4
            row_logits = logits + aligned
            lead = (first - aligned).to(tl.int32)
            span = lead + length
            readable = tl.minimum(extent - aligned, (span + 3) // 4 * 4).to(tl.int32)
            found = tl.full((), CANDIDATES + 1, tl.int32)
            if k <= CANDIDATES:
                bound = tl.full((), 0, tl.uint32)
                if k <= BLOCK:
                    group_max = tl.zeros((BLOCK,), tl.uint32)
                    for offset in range(0, span, BLOCK):
                        key, inside, column = _load_keys(row_logits, offset, lead, span, readable, BLOCK)
                        group_max = tl.maximum(group_max, tl.where(inside, key, 0))
                    bound, _, _ = _select_in_registers(group_max, group_max != 0, k + tl.zeros((), tl.int32), 2,
                                                       RADIX_BITS)
                found = tl.full((), 0, tl.int32)
                for offset in range(0, span, BLOCK):
                    key, inside, column = _load_keys(row_logits, offset, lead, span, readable, BLOCK)
                    candidate = (inside & (key >= bound)).to(tl.int32)
                    slot = found + tl.cumsum(candidate, 0) - candidate
                    fits = (candidate != 0) & (slot < CANDIDATES)
                    tl.store(candidate_keys + slot, key.to(tl.int32, bitcast=True), mask=fits)
                    tl.store(candidate_columns + slot, column, mask=fits)
                    found += tl.sum(candidate, 0)
            if found <= CANDIDATES:
                tl.debug_barrier()
                slots = tl.arange(0, CANDIDATES)
                valid = slots < found
                keys = tl.load(candidate_keys + slots, mask=valid, other=0).to(tl.uint32, bitcast=True)
                columns = tl.load(candidate_columns + slots, mask=valid, other=0)
                tl.debug_barrier()
                prefix, prefix_mask, needed = _select_in_registers(keys, valid, k + tl.zeros((), tl.int32), DIGITS,
                                                                   RADIX_BITS)
                _write_kept(row_out, row_rows, keys, valid, columns, prefix, prefix_mask, needed, 0, 0, HAS_TABLE)
            else:
                prefix = tl.full((), 0, tl.uint32)
                prefix_mask = tl.full((), 0, tl.uint32)
                needed = k + tl.zeros((), tl.int32)
                unresolved = needed > 0
                for digit in tl.static_range(DIGITS):
                    if unresolved:
                        SHIFT: tl.constexpr = 32 - RADIX_BITS * (digit + 1)
                        counts = tl.zeros((BINS,), tl.int32)
                        for offset in range(0, span, BLOCK):
                            key, inside, column = _load_keys(row_logits, offset, lead, span, readable, BLOCK)
                            counts += _digits(key, inside, prefix, prefix_mask, SHIFT, BINS)
                        prefix, prefix_mask, needed, unresolved = _narrow(counts, prefix, prefix_mask, needed, SHIFT,
                                                                          BINS)
                above_before = tl.full((), 0, tl.int32)
                ties_before = tl.full((), 0, tl.int32)
                for offset in range(0, span, BLOCK):
                    key, inside, column = _load_keys(row_logits, offset, lead, span, readable, BLOCK)
                    above_before, ties_before = _write_kept(row_out, row_rows, key, inside, column, prefix,
                                                            prefix_mask, needed, above_before, ties_before, HAS_TABLE)


def main() -> None:
    """Check the top-k kernel against the OpSpec reference on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("indexer_topk")


if __name__ == "__main__":
    main()
