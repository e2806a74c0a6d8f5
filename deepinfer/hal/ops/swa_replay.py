"""Sliding-window (SWA) ring addressing: where window keys live, and index lists that read them.

Each sequence owns a state slot ``s``; its SWA keys live in a ring of ``ring_size = window +
max_backtracking`` rows, the key at absolute position ``p`` at flat ring row
``s * ring_size + p % ring_size``. The ``max_backtracking`` spare rows keep the keys a rollback
may need again. A query at position ``p`` sees the keys at ``p - window + 1 .. p`` (ascending),
except those before ``max(0, visible_start)``: bounded replay of a prompt's last KEEP tokens sets
``visible_start`` to the first kept position, so the first kept queries see a narrowed window.
Index lists use ``-1`` for keys a query does not see."""
from __future__ import annotations

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks


def swa_ring_slots(state_slots: torch.Tensor, positions: torch.Tensor, ring_size: int) -> torch.Tensor:
    """Flat ring rows ``int64 [n]`` of the keys at ``positions [n]`` of sequences ``state_slots [n]``.

    ``-1`` where the state slot is ``-1`` (a padding row) or the position is negative, so the
    result can go straight to ``kv_store``."""
    check_index_vectors(state_slots=state_slots, positions=positions)
    check_positive(ring_size=ring_size)
    return _ring_rows(state_slots, positions, ring_size)


def swa_decode_indices(state_slots: torch.Tensor, positions: torch.Tensor, window: int, ring_size: int,
                       visible_start: torch.Tensor | None = None) -> torch.Tensor:
    """Index list ``int32 [T, window]`` of each query's window keys in the ring.

    Row ``t`` (query at ``positions[t]`` of sequence ``state_slots[t]``) lists the flat ring
    rows of key positions ``p - window + 1 .. p`` in ascending order, ``-1`` for key positions
    before ``max(0, visible_start[t])``; a padding row (state slot ``-1``) is all ``-1``.
    Requires ``window <= ring_size``; the ring must hold every key up to ``p`` and none past
    ``p + ring_size - window``."""
    check_index_vectors(state_slots=state_slots, positions=positions, visible_start=visible_start)
    check_window(window, ring_size)
    key_positions = _window_key_positions(positions, window)
    rows = _ring_rows(state_slots.unsqueeze(1), key_positions, ring_size)
    return _mask_invisible(rows, key_positions, visible_start)


def swa_prefill_indices(positions: torch.Tensor, chunk_start: torch.Tensor, history_offset: torch.Tensor,
                        chunk_offset: torch.Tensor, window: int,
                        visible_start: torch.Tensor | None = None) -> torch.Tensor:
    """Index list ``int32 [T, window]`` of each query's window keys in a gathered prefill buffer.

    Per sequence the buffer holds a history segment of ``window - 1`` rows (key positions
    ``chunk_start - window + 1 .. chunk_start - 1``, from row ``history_offset``) and the chunk's
    own keys (position ``chunk_start + j`` at row ``chunk_offset + j``); all four per-query
    vectors are ``int64 [T]`` with ``positions >= chunk_start``. Key positions are ordered and
    masked as in :func:`swa_decode_indices`."""
    check_index_vectors(positions=positions, chunk_start=chunk_start, history_offset=history_offset,
                         chunk_offset=chunk_offset, visible_start=visible_start)
    check_positive(window=window)
    if value_checks():
        check_after_chunk_start(positions, chunk_start)
    key_positions = _window_key_positions(positions, window)
    start, history, chunk = chunk_start.unsqueeze(1), history_offset.unsqueeze(1), chunk_offset.unsqueeze(1)
    rows = torch.where(key_positions >= start, chunk + (key_positions - start),
                       history + (key_positions - (start - window + 1)))
    return _mask_invisible(rows, key_positions, visible_start)


def swa_history_slots(state_slots: torch.Tensor, chunk_start: torch.Tensor, window: int,
                      ring_size: int) -> torch.Tensor:
    """Flat ring rows ``int64 [B, window - 1]`` of key positions ``chunk_start - window + 1 ..
    chunk_start - 1`` (``-1`` where negative): the history segment to gather with ``kv_load``
    before the chunk's own keys are stored (they may overwrite it)."""
    check_index_vectors(state_slots=state_slots, chunk_start=chunk_start)
    check_window(window, ring_size)
    key_positions = _window_key_positions(chunk_start - 1, window - 1)
    return _ring_rows(state_slots.unsqueeze(1), key_positions, ring_size)


def _window_key_positions(last: torch.Tensor, count: int) -> torch.Tensor:
    """``int64 [n, count]``: positions ``last - count + 1 .. last`` of each row, ascending."""
    return last.unsqueeze(1) + torch.arange(1 - count, 1, device=last.device)


def _ring_rows(state_slots: torch.Tensor, positions: torch.Tensor, ring_size: int) -> torch.Tensor:
    rows = state_slots * ring_size + positions.remainder(ring_size)
    return torch.where((state_slots >= 0) & (positions >= 0), rows, torch.full_like(rows, -1))


def _mask_invisible(rows: torch.Tensor, key_positions: torch.Tensor, visible_start: torch.Tensor | None):
    first_visible = torch.zeros_like(key_positions[:, :1]) if visible_start is None \
        else visible_start.clamp(min=0).unsqueeze(1)
    return torch.where(key_positions >= first_visible, rows, torch.full_like(rows, -1)).to(torch.int32)


def check_index_vectors(**vectors: torch.Tensor | None) -> None:
    lengths = set()
    for name, value in vectors.items():
        if value is None:
            continue
        if value.dim() != 1 or value.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 vector, got {value.dtype} {tuple(value.shape)}")
        lengths.add(value.shape[0])
    if len(lengths) > 1:
        shapes = {name: tuple(v.shape) for name, v in vectors.items() if v is not None}
        raise ValueError(f"per-row vectors must have one length; got {shapes}")


def check_after_chunk_start(positions: torch.Tensor, chunk_start: torch.Tensor) -> None:
    before_chunk = (positions < chunk_start).nonzero()
    if before_chunk.numel():
        row = before_chunk[0, 0].item()
        raise ValueError(f"every query position must be >= its chunk_start; row {row} has position "
                         f"{positions[row].item()} < chunk_start {chunk_start[row].item()}")


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_window(window: int, ring_size: int) -> None:
    check_positive(window=window, ring_size=ring_size)
    if window > ring_size:
        raise ValueError(f"window {window} does not fit the ring of {ring_size} rows; ring_size must be "
                         "window + max_backtracking >= window")


def _sequences(gen: torch.Generator, batch: int, max_start: int, tokens: int):
    """``batch`` sequences of ``tokens`` consecutive queries from random starts (the first at 0):
    per-sequence starts, and per-query owning sequence and position."""
    start = torch.randint(0, max_start + 1, (batch,), generator=gen)
    start[0] = 0
    owner = torch.arange(batch).repeat_interleave(tokens)
    return start, owner, start[owner] + torch.arange(tokens).repeat(batch)


def _visible_start(gen: torch.Generator, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Kept-suffix starts: some after the query, some inside its window, some before it."""
    return positions - torch.randint(-2, window + 3, positions.shape, generator=gen)


def _on(device: torch.device, args: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _ring_case(n: int, ring_size: int):
    def make(gen: torch.Generator, device: torch.device):
        state_slots = torch.randint(0, 8, (n,), generator=gen)
        state_slots[0] = -1
        positions = torch.randint(-2, 4 * ring_size, (n,), generator=gen)
        return _on(device, {"state_slots": state_slots, "positions": positions, "ring_size": ring_size})
    return make


def _decode_case(batch: int, tokens: int, window: int, ring_size: int, with_visible: bool):
    def make(gen: torch.Generator, device: torch.device):
        _, owner, positions = _sequences(gen, batch, 3 * window, tokens)
        state_slots = torch.randperm(2 * batch, generator=gen)[:batch]
        args = {"state_slots": state_slots[owner], "positions": positions, "window": window,
                "ring_size": ring_size}
        if with_visible:
            args["visible_start"] = _visible_start(gen, positions, window)
        return _on(device, args)
    return make


def _prefill_case(batch: int, tokens: int, window: int, with_visible: bool):
    def make(gen: torch.Generator, device: torch.device):
        start, owner, positions = _sequences(gen, batch, 3 * window, tokens)
        history_offset = torch.arange(batch) * (window - 1)
        chunk_offset = batch * (window - 1) + torch.arange(batch) * tokens
        args = {"positions": positions, "chunk_start": start[owner], "history_offset": history_offset[owner],
                "chunk_offset": chunk_offset[owner], "window": window}
        if with_visible:
            args["visible_start"] = _visible_start(gen, positions, window)
        return _on(device, args)
    return make


def _history_case(batch: int, window: int, ring_size: int):
    def make(gen: torch.Generator, device: torch.device):
        start, _, _ = _sequences(gen, batch, 3 * window, 1)
        state_slots = torch.randperm(2 * batch, generator=gen)[:batch]
        return _on(device, {"state_slots": state_slots, "chunk_start": start, "window": window,
                            "ring_size": ring_size})
    return make


register(OpSpec(
    name="swa_ring_slots",
    activations=False,
    summary="flat SWA ring row of each (state slot, position); -1 for padding",
    reference=swa_ring_slots,
    cases=(OpCase("tiny", _ring_case(9, 6)), OpCase("v41", _ring_case(64, 134), size="real")),
))

register(OpSpec(
    name="swa_decode_indices",
    activations=False,
    summary="per-query window key rows in the SWA ring (decode), -1 outside the visible range",
    reference=swa_decode_indices,
    cases=(
        OpCase("tiny", _decode_case(5, 1, 4, 6, False)),
        OpCase("tiny_multi_token_visible", _decode_case(3, 3, 4, 6, True)),
        OpCase("v41", _decode_case(64, 1, 128, 134, False), size="real"),
        OpCase("v41_multi_token_visible", _decode_case(16, 4, 128, 134, True), size="real"),
    ),
))

register(OpSpec(
    name="swa_prefill_indices",
    activations=False,
    summary="per-query window key rows in the gathered [history | chunk] prefill buffer",
    reference=swa_prefill_indices,
    cases=(
        OpCase("tiny", _prefill_case(2, 5, 4, False)),
        OpCase("tiny_visible", _prefill_case(3, 5, 4, True)),
        OpCase("v41", _prefill_case(2, 32, 128, False), size="real"),
        OpCase("v41_visible", _prefill_case(2, 32, 128, True), size="real"),
    ),
))

register(OpSpec(
    name="swa_history_slots",
    activations=False,
    summary="ring rows of the window - 1 keys before each chunk (the prefill history segment)",
    reference=swa_history_slots,
    cases=(OpCase("tiny", _history_case(4, 4, 6)), OpCase("v41", _history_case(64, 128, 134), size="real")),
))
