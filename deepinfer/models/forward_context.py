"""ForwardContext: everything one model forward needs to know about the batch.

Two ways to build one, neither reading a device tensor on the host: from plain lists
(:meth:`ForwardContext.for_sequences`: every index array computed in Python and moved to the
device in one transfer), and, for decode steps, from a few device tensors
(:meth:`ForwardContext.for_decode`: the rest derived on the device, so a captured CUDA graph or
a device-side fix-up of the inputs can feed it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

Upload = Callable[[np.ndarray], torch.Tensor]
"""Moves one host int64 array to the device as one transfer (the engine's pinned staging)."""


@dataclass
class ConsumerRows:
    """SWA bounded replay's compact layout, computed on the host: the ``rows`` (ascending) the
    YOCO consumer layers compute (a suffix of each chunk), their ``counts``, ``query_start`` and
    first position (``chunk_start``) per sequence, and where each of the context's logits rows
    falls among them (``logits_indices``)."""

    rows: torch.Tensor
    counts: torch.Tensor
    query_start: torch.Tensor
    chunk_start: torch.Tensor
    logits_indices: torch.Tensor


@dataclass
class ForwardContext:
    """Per-step metadata of a packed batch (the tokens of each sequence are contiguous).

    ``positions`` are absolute positions inside each sequence; ``context_lens[b]`` is the number
    of tokens sequence ``b`` holds after this step; ``block_tables[b]`` lists its paged-cache
    blocks (padding entries are never addressed); ``state_slots[b]`` is its SWA-ring /
    compress-state slot. Per token: ``seq_of_token``, ``chunk_start_of_token`` (the first
    position of its sequence in this step), ``slot_of_token``; ``query_start [B + 1]`` are the
    sequences' first rows. ``logits_indices`` selects the rows whose logits are returned;
    ``every_row_logits`` says it is every row in order (``arange``), which needs no gather.
    ``decode`` asks for the decode path (every sequence has ``decode_query_len`` query tokens,
    and compressed keys are laid out per sequence up to the block table's width).
    ``context_lens_host`` and ``query_lens_host`` hold the context and query lengths on the host
    where the builder knew them (prefill steps size and group their compressed keys with them). ``write_draft_cache``: the
    target forward also writes the DSpark draft layers' main keys. ``draft_block`` > 0 marks a
    DSpark draft pass: each sequence's rows are one block that attends bidirectionally to itself
    and to the ``window`` keys before it. ``replay_start`` (SWA bounded replay; None: off) is
    ``int64 [B]``, the first position of each sequence the YOCO consumer layers process and see;
    ``replay_compact`` computes only the rows of ``consumer`` there instead of masking. ``shard``
    (a :class:`~deepinfer.parallel.context.ContextShard`; None: the whole step) marks one
    context-parallel rank's rows of a prefill step: the per-token fields are that rank's rows,
    and the cache writes go through ``shard.full``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    seq_of_token: torch.Tensor
    query_start: torch.Tensor
    chunk_start: torch.Tensor
    chunk_start_of_token: torch.Tensor
    slot_of_token: torch.Tensor
    num_seqs: int
    decode: bool = False
    decode_query_len: int = 0
    context_lens_host: tuple[int, ...] | None = None
    query_lens_host: tuple[int, ...] | None = None
    write_draft_cache: bool = False
    draft_block: int = 0
    replay_start: torch.Tensor | None = None
    replay_compact: bool = False
    consumer: ConsumerRows | None = None
    every_row_logits: bool = False
    shard: object | None = None
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def derived(self, key: tuple, compute: Callable[[], object]):
        """``compute()`` once per context and ``key``: index tensors every layer of one kind
        derives from this context alike (cache rows, ring slots), built by the first layer that
        asks and shared by the rest. A context made with ``dataclasses.replace`` starts empty."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @classmethod
    def for_sequences(cls, token_chunks: Sequence[Sequence[int]], start_positions: Sequence[int],
                      state_slots: Sequence[int], block_tables: Sequence[Sequence[int]], decode: bool = False,
                      all_logits: bool = False, logits_rows: Sequence[int] | None = None,
                      replay_starts: Sequence[int] | None = None, replay_compact: bool = False,
                      block_table_width: int | None = None, device: torch.device | str = "cpu",
                      upload: Upload | None = None) -> "ForwardContext":
        """Build a context from plain lists (one entry per sequence), all on the host, moved to
        ``device`` by one ``upload`` (default: a plain copy).

        Logits come from ``logits_rows`` when given, else every row (``all_logits``) or the last
        row of each sequence. ``replay_starts`` (bounded replay) sets ``replay_start``; with
        ``replay_compact`` the consumer rows are laid out here, and a logits row the consumer
        layers skip is refused. ``block_table_width`` pads the tables (default: the longest)."""
        lens = [len(chunk) for chunk in token_chunks]
        if decode and len(set(lens)) > 1:
            raise ValueError(f"the decode path needs equal query lengths per sequence, got {lens}")
        num_seqs, starts = len(lens), list(start_positions)
        ends = np.cumsum(lens, dtype=np.int64)
        query_start = np.concatenate(([0], ends)).astype(np.int64)
        seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int64), lens)
        chunk_start = np.asarray(starts, dtype=np.int64).reshape(num_seqs)
        positions = chunk_start[seq_of_token] + np.arange(int(ends[-1]) if num_seqs else 0) - query_start[seq_of_token]
        context_lens = chunk_start + np.asarray(lens, dtype=np.int64)
        width = block_table_width if block_table_width is not None else max((len(b) for b in block_tables), default=0)
        table = np.full((num_seqs, width), -1, dtype=np.int64)
        for row, blocks in enumerate(block_tables):
            table[row, :len(blocks)] = blocks
        if logits_rows is None:
            logits_rows = np.arange(len(seq_of_token)) if all_logits else ends - 1
        slots = np.asarray(state_slots, dtype=np.int64).reshape(num_seqs)
        input_ids = np.concatenate([np.asarray(chunk, dtype=np.int64).reshape(-1) for chunk in token_chunks]) \
            if num_seqs else np.zeros(0, dtype=np.int64)
        arrays = {"input_ids": input_ids, "positions": positions,
                  "query_lens": lens, "context_lens": context_lens, "state_slots": slots, "block_tables": table,
                  "logits_indices": logits_rows, "seq_of_token": seq_of_token, "query_start": query_start,
                  "chunk_start": chunk_start, "chunk_start_of_token": chunk_start[seq_of_token],
                  "slot_of_token": slots[seq_of_token]}
        if replay_starts is not None:
            replay = np.maximum(np.asarray(replay_starts, dtype=np.int64).reshape(num_seqs), 0)
            arrays["replay_start"] = replay
            layout = _consumer_layout(replay, chunk_start, context_lens, query_start, positions, seq_of_token,
                                      np.asarray(logits_rows, dtype=np.int64))
            if replay_compact:
                arrays.update(layout)
        tensors = upload_arrays(arrays, device, upload)
        consumer = None
        if "consumer_rows" in tensors:
            consumer = ConsumerRows(*(tensors.pop(f"consumer_{name}") for name in
                                      ("rows", "counts", "query_start", "chunk_start", "logits")))
        tensors["block_tables"] = tensors["block_tables"].view(num_seqs, width)
        return cls(**tensors, num_seqs=num_seqs, decode=decode, decode_query_len=lens[0] if decode and lens else 0,
                   context_lens_host=tuple(int(n) for n in context_lens), query_lens_host=tuple(lens),
                   replay_compact=replay_compact,
                   consumer=consumer)

    @classmethod
    def for_decode(cls, input_ids: torch.Tensor, start_positions: torch.Tensor, state_slots: torch.Tensor,
                   block_tables: torch.Tensor, query_len: int, replay_start: torch.Tensor | None = None,
                   draft_block: int = 0, write_draft_cache: bool = False) -> "ForwardContext":
        """A decode context from device tensors: ``input_ids [B * query_len]`` (each sequence's
        rows together), ``start_positions [B]`` (position of each sequence's first row),
        ``state_slots [B]``, ``block_tables [B, W]``; every other field is derived on the
        device, without reading a value on the host. Every row gets logits."""
        num_seqs = start_positions.shape[0]
        rows, seq_of_token, offsets, query_lens, query_start = decode_layout(num_seqs, query_len,
                                                                             start_positions.device)
        if query_len == 1:  # a row per sequence: its start is its position, its slot the row's
            chunk_start_of_token, positions, slot_of_token = start_positions, start_positions, state_slots
        else:
            chunk_start_of_token = start_positions[seq_of_token]
            positions, slot_of_token = chunk_start_of_token + offsets, state_slots[seq_of_token]
        return cls(input_ids=input_ids, positions=positions, query_lens=query_lens,
                   context_lens=start_positions + query_len, state_slots=state_slots, block_tables=block_tables,
                   logits_indices=rows, seq_of_token=seq_of_token, query_start=query_start,
                   chunk_start=start_positions, chunk_start_of_token=chunk_start_of_token,
                   slot_of_token=slot_of_token, num_seqs=num_seqs, decode=True, decode_query_len=query_len,
                   draft_block=draft_block, write_draft_cache=write_draft_cache, replay_start=replay_start,
                   every_row_logits=True)


_DECODE_LAYOUTS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def decode_layout(num_seqs: int, query_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(rows, seq_of_token, row offsets in their sequence, query_lens, query_start)`` of a decode
    batch of ``num_seqs`` sequences of ``query_len`` rows: int64 tensors fixed by the shape, made
    once per shape and device and shared (read-only) by every context of that shape, so a decode
    step launches nothing for them. Made during a CUDA graph capture they are not kept (the
    capture does not run the kernels that fill them); an eager warm-up fills the table first."""
    key = (num_seqs, query_len, torch.device(device))
    layout = _DECODE_LAYOUTS.get(key)
    if layout is None:
        rows = torch.arange(num_seqs * query_len, device=device)
        layout = (rows, rows // query_len, rows % query_len,
                  torch.full((num_seqs,), query_len, dtype=torch.int64, device=device),
                  torch.arange(num_seqs + 1, device=device) * query_len)
        if not (layout[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            _DECODE_LAYOUTS[key] = layout
    return layout


def _consumer_layout(replay, chunk_start, context_lens, query_start, positions, seq_of_token, logits_rows):
    """Bounded replay's compact rows: per chunk its positions at or after the replay start, else
    its last row; and where the logits rows fall among them (a skipped row is refused)."""
    first = np.minimum(np.maximum(replay, chunk_start), context_lens - 1)
    kept = positions >= first[seq_of_token]
    rows = np.flatnonzero(kept)
    at = np.searchsorted(rows, logits_rows)
    missing = [row for row, i in zip(logits_rows.tolist(), at.tolist()) if i >= len(rows) or rows[i] != row]
    if missing:
        row = missing[0]
        seq = int(seq_of_token[row])
        raise ValueError(f"logits of row {row} (position {int(positions[row])} of sequence {seq}) were asked for, "
                         f"but under bounded replay the consumer layers only process positions >= replay_start "
                         f"{int(replay[seq])} and each chunk's last row; ask for those rows only (prompt logprobs "
                         f"need engine.bounded_replay.mode=off)")
    counts = np.bincount(seq_of_token[rows], minlength=len(chunk_start)).astype(np.int64)
    return {"consumer_rows": rows, "consumer_counts": counts,
            "consumer_query_start": np.concatenate(([0], np.cumsum(counts))), "consumer_chunk_start": context_lens - counts,
            "consumer_logits": at}


def upload_arrays(arrays: dict, device, upload: Upload | None = None) -> dict[str, torch.Tensor]:
    """Every array as a flat int64 tensor on ``device``, moved there as one buffer (by
    ``upload`` when given)."""
    flat = [np.asarray(value, dtype=np.int64).reshape(-1) for value in arrays.values()]
    buffer = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    moved = upload(buffer) if upload is not None else torch.from_numpy(buffer).to(device)
    out, offset = {}, 0
    for name, values in zip(arrays, flat):
        out[name] = moved[offset:offset + values.size]
        offset += values.size
    return out
