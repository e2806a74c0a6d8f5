"""Balanced ("mirror") context parallelism for prefill steps.

Every rank of the context-parallel group runs the same engine over the same requests. A
prefill step's chunk of each sequence is cut into ``2 * world`` contiguous pieces of
``ceil(rows / (2 * world))`` rows, and rank ``r`` computes pieces ``r`` and ``2 * world - 1 - r``,
so every rank gets an even share of the causal attention work. The query side of each layer
(projections, attention, MoE) runs on the rank's rows only; the tensors the caches are written
from (SWA keys, the compressor's inputs, the draft layers' features) are all-gathered and put
back in the chunk's order, so every rank writes the whole chunk into its own cache replica and
its queries read every key. The last hidden states are gathered the same way before the LM head.
Decode steps run whole on every rank; the logits every rank samples from are CP rank 0's
(:func:`from_first_rank`), which keeps the ranks' schedulers in step."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.models.forward_context import ForwardContext, Upload, upload_arrays


def balanced_rows(query_lens: list[int] | tuple[int, ...], rank: int, world: int) -> np.ndarray:
    """The rows (ascending) rank ``rank`` of ``world`` computes of a chunk whose sequences have
    ``query_lens`` rows each: per sequence, pieces ``rank`` and ``2 * world - 1 - rank`` of its
    ``2 * world`` pieces (the last pieces of a short sequence may be empty)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {world}")
    pieces, rows, start = 2 * world, [], 0
    for length in query_lens:
        size = -(-length // pieces)
        for piece in (rank, pieces - 1 - rank):
            lo = start + min(piece * size, length)
            rows.append(np.arange(lo, start + min((piece + 1) * size, length), dtype=np.int64))
        start += length
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


@dataclass
class ContextShard:
    """One rank's share of a prefill step: its ``rows`` of the ``full`` context, and how its
    peers' rows fit back in the chunk's order: each rank's rows are padded to ``width``, and
    ``restore[j]`` is where full row ``j`` lies in the gathered ``[world * width]`` rows."""

    full: ForwardContext
    rows: torch.Tensor
    restore: torch.Tensor
    width: int
    world: int
    group: object

    def gather(self, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's rows of each ``local`` tensor (``[rows, ...]``, one dtype) in the full
        context's row order, in one all-gather."""
        if len({t.dtype for t in local}) != 1:
            raise ValueError(f"gathered tensors share one dtype, got {[t.dtype for t in local]}")
        widths = [int(np.prod(t.shape[1:])) for t in local]
        packed = torch.cat([t.reshape(t.shape[0], -1) for t in local], dim=1)
        padded = packed.new_zeros(self.width, packed.shape[1])
        padded[:packed.shape[0]] = packed
        if dist.get_backend(self.group) == "gloo":
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded, group=self.group)
            gathered = torch.cat(parts)
        else:
            gathered = padded.new_empty(self.world * self.width, padded.shape[1])
            dist.all_gather_into_tensor(gathered, padded, group=self.group)
        ordered = gathered.index_select(0, self.restore)
        return tuple(part.reshape(-1, *t.shape[1:])
                     for part, t in zip(ordered.split(widths, dim=1), local))


def shard_context(full: ForwardContext, rank: int, world: int, group, upload: Upload | None = None) -> ForwardContext:
    """Rank ``rank``'s view of the prefill context ``full``: its per-token fields cut to the
    rank's :func:`balanced_rows`, its per-sequence fields kept, ``shard`` holding the way back
    to ``full``. ``full`` itself where some rank would get no row (a step too short to split:
    every rank computes it whole) or where it is a decode context (always run whole)."""
    if full.decode or full.query_lens_host is None:
        return full
    shares = [balanced_rows(full.query_lens_host, r, world) for r in range(world)]
    if min(len(rows) for rows in shares) == 0:
        return full
    width = max(len(rows) for rows in shares)
    restore = np.empty(full.num_tokens, dtype=np.int64)
    for r, rows in enumerate(shares):
        restore[rows] = r * width + np.arange(len(rows))
    mine = shares[rank]
    seq_of_row = np.repeat(np.arange(full.num_seqs), full.query_lens_host)[mine]
    counts = np.bincount(seq_of_row, minlength=full.num_seqs).astype(np.int64)
    moved = upload_arrays({"rows": mine, "restore": restore, "counts": counts,
                           "query_start": np.concatenate(([0], np.cumsum(counts)))},
                          full.input_ids.device, upload)
    rows = moved["rows"]
    shard = ContextShard(full, rows, moved["restore"], width, world, group)
    return dataclasses.replace(
        full, input_ids=full.input_ids[rows], positions=full.positions[rows], query_lens=moved["counts"],
        seq_of_token=full.seq_of_token[rows], query_start=moved["query_start"],
        chunk_start_of_token=full.chunk_start_of_token[rows], slot_of_token=full.slot_of_token[rows],
        query_lens_host=tuple(int(n) for n in counts), replay_compact=False, consumer=None,
        every_row_logits=False, shard=shard)


def from_first_rank(tensor: torch.Tensor, group) -> torch.Tensor:
    """The first rank of ``group``'s ``tensor``, on every rank of it (in place). Under context
    parallelism every rank samples from the first rank's logits and verifies its drafts, so all
    of them emit the same tokens (the draws are counter-based) whatever their own kernels
    rounded."""
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return tensor
