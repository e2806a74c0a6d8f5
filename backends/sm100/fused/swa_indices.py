"""SWA ring addressing in two Triton kernels of integer arithmetic, one program per tile of
(row, key) pairs: key positions ``anchor + first_offset + j``, their flat ring rows (a floor
modulo) or their rows in the gathered prefill buffer, ``-1`` where a key is not visible."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_ELEMENTS = 2048
"""(row, key) pairs per program."""
MAX_BLOCK_KEYS = 128
"""Widest key block of a program; longer key lists take several blocks."""


@triton.jit
def floor_mod(value, divisor):
    """``value mod divisor`` in ``[0, divisor)``, like Python's (Triton's ``%`` truncates)."""
    remainder = value % divisor
    return tl.where(remainder < 0, remainder + divisor, remainder)


@triton.jit
def _first_visible(visible_start, rows, live, HAS_VISIBLE: tl.constexpr):
    """``max(0, visible_start[rows])`` (0 without ``visible_start``), as a column."""
    if HAS_VISIBLE:
        first = tl.maximum(tl.load(visible_start + rows, mask=live, other=0), 0)
    else:
        first = tl.zeros_like(rows).to(tl.int64)
    return first[:, None]


@triton.jit
def ring_window_kernel(state_slots, anchors, visible_start, out, n, count, first_offset, ring_size,
                       HAS_VISIBLE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    """``out [n, count]`` (its dtype) for the tile at ``(pid0, pid1)``: the flat ring row
    ``state_slots[i] * ring_size + k mod ring_size`` of key position ``k = anchors[i] +
    first_offset + j``; ``-1`` where the slot is negative or ``k < max(0, visible_start[i])``."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    keys = tl.program_id(1) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    live = rows < n
    inside = live[:, None] & (keys < count)[None, :]
    slot = tl.load(state_slots + rows, mask=live, other=-1)[:, None]
    key = tl.load(anchors + rows, mask=live, other=0)[:, None] + first_offset + keys[None, :]
    visible = (slot >= 0) & (key >= _first_visible(visible_start, rows, live, HAS_VISIBLE))
    value = tl.where(visible, slot * ring_size + floor_mod(key, ring_size), -1)
    tl.store(out + rows.to(tl.int64)[:, None] * count + keys[None, :], value.to(out.dtype.element_ty), mask=inside)


@triton.jit
def prefill_window_kernel(positions, chunk_start, history_offset, chunk_offset, visible_start, out, n, window,
                          HAS_VISIBLE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    """``out int32 [n, window]`` for the tile at ``(pid0, pid1)``: key position ``k = positions[i]
    - window + 1 + j`` at buffer row ``chunk_offset[i] + k - chunk_start[i]`` when ``k >=
    chunk_start[i]``, else ``history_offset[i] + k - (chunk_start[i] - window + 1)``; ``-1``
    where ``k < max(0, visible_start[i])``."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    keys = tl.program_id(1) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    live = rows < n
    inside = live[:, None] & (keys < window)[None, :]
    start = tl.load(chunk_start + rows, mask=live, other=0)[:, None]
    history = tl.load(history_offset + rows, mask=live, other=0)[:, None]
    chunk = tl.load(chunk_offset + rows, mask=live, other=0)[:, None]
    key = tl.load(positions + rows, mask=live, other=0)[:, None] + (1 - window) + keys[None, :]
    row = tl.where(key >= start, chunk + (key - start), history + (key - (start - window + 1)))
    value = tl.where(key >= _first_visible(visible_start, rows, live, HAS_VISIBLE), row, -1)
    tl.store(out + rows.to(tl.int64)[:, None] * window + keys[None, :], value.to(tl.int32), mask=inside)


def main() -> None:
    """Check the SWA index kernels against the OpSpec references on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("swa_ring_slots", "swa_decode_indices", "swa_prefill_indices", "swa_history_slots")


if __name__ == "__main__":
    main()
