"""Turning a step's logits into emitted tokens: plain sampling, or DSpark verification.

All of it runs on the device: the step's sampling parameters go up in one transfer, and the
chosen tokens, acceptance flags, exact acceptance chances and asked-for log-probabilities come
back in one copy, which the host waits for only when it collects the step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from deepinfer.engine.device import Runtime
from deepinfer.hal.ops.sampling import as_int64, verify_row_positions
from deepinfer.hal.ops.speculative import acceptance_probability
from deepinfer.hal.registry import OpTable
from deepinfer.hal.value_checks import skip_value_checks


@dataclass
class Emission:
    """What one request emits in a step: tokens (accepted drafts, then the final row's token),
    their top log-probabilities when asked, and verification statistics."""

    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    drafted: int = 0
    accepted: int = 0
    calibration_errors: list[float] = field(default_factory=list)


class PendingEmissions:
    """A launched sampling step; :meth:`collect` waits for its one copy to the host and returns
    each chunk's :class:`Emission`."""

    def __init__(self, chunks, fetch: Callable[[], torch.Tensor] | None, top: int):
        self.chunks, self._fetch, self._top = chunks, fetch, top

    def collect(self) -> list[Emission]:
        if self._fetch is None:
            return []
        result = self._fetch().numpy()
        if result.ndim == 1:  # the tokens alone: no draft verified, no log-probability asked for
            zeros = np.zeros(result.shape[0])
            result = np.stack((result.astype(np.float64), zeros, zeros, np.full_like(zeros, np.nan)))
        return _emissions(self.chunks, result, self._top)


@dataclass
class SlotTokens:
    """What each request's last step left on the device, by state slot: ``last [S]`` the token
    it emitted last, ``length [S]`` its computed tokens after that step (the position of that
    token: where its next input sits), ``drafts [S, k]`` the drafts proposed for it last. The
    sampler writes ``last`` and ``length``, the draft pass ``drafts``; a later step's inputs
    read them there, so nothing waits for the host."""

    last: torch.Tensor
    length: torch.Tensor
    drafts: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, num_drafts: int, device: torch.device) -> "SlotTokens":
        new = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        return cls(new(num_slots), new(num_slots), new(num_slots, max(num_drafts, 1)))


def emit(ops: OpTable, runtime: Runtime, chunks, logits: torch.Tensor,
         masks: tuple[torch.Tensor, torch.Tensor] | None = None, slots: SlotTokens | None = None,
         filter_order: str = "deepinfer") -> PendingEmissions:
    """Launch the sampling of a step. ``logits`` holds, for each sampling chunk in order, one
    row per verified draft plus the final row. Draws are keyed by (seed, draw position), so they
    do not depend on the rest of the batch: with ``base`` the position of the token a chunk's
    first row emits (a prefill chunk's length after it, DeepInfer's ``seqlen_k``; a decode
    chunk's start + 1, its ``seqlen_k - seqlen_q + 1``), row ``j`` draws at
    ``base + j * VERIFY_ROW_STRIDE`` (:func:`~deepinfer.hal.ops.sampling.verify_row_positions`),
    as DeepInfer 0.1.0 keys its verification rows. ``filter_order``
    (``decoding.filter_order``) orders top-p and top-k in the target distribution that tokens are
    drawn from and drafts are verified against. ``masks`` (grammar bitmasks and
    their rows) are applied first, so sampling, verification and logprobs all see the
    constrained distribution. With ``slots``, each chunk's final token and the request's new
    length are written at its state slot, a ``chained`` chunk's positions start from the length
    there, and drafts still on the device (placeholders) are read there. The ops skip their
    value checks (the engine validated every parameter on the host): reading a device value
    here would wait for the step's forward, which is what asynchronous scheduling overlaps with
    the host's work."""
    with skip_value_checks():
        return _emit(ops, runtime, chunks, logits, masks, slots, filter_order)


def _emit(ops: OpTable, runtime: Runtime, chunks, logits: torch.Tensor, masks, slots, filter_order) -> PendingEmissions:
    rows = [(chunk, j) for chunk in chunks for j in range(len(chunk.drafts) + 1)]
    if not rows:
        return PendingEmissions(chunks, None, 0)
    device = logits.device
    if masks is not None:
        logits = ops.apply_token_bitmask(logits, masks[0].to(device), masks[1].to(device))
    count, n = len(rows), len(chunks)
    params = [chunk.request.params for chunk, _ in rows]
    verify = [i for i, (chunk, j) in enumerate(rows) if j < len(chunk.drafts)]
    width = max(len(chunk.drafts) for chunk in chunks)
    first, verify_rows = np.zeros(n, dtype=np.int64), np.full((n, max(width, 1)), count, dtype=np.int64)
    for c, chunk in enumerate(chunks):
        first[c] = first[c - 1] + len(chunks[c - 1].drafts) + 1 if c else 0
        verify_rows[c, :len(chunk.drafts)] = first[c] + np.arange(len(chunk.drafts))
    starts = np.asarray([chunk.start for chunk, _ in rows], dtype=np.int64)
    offsets = np.asarray([len(chunk.token_ids) - len(chunk.drafts) for chunk, _ in rows], dtype=np.int64)
    chained = np.asarray([chunk.chained for chunk, _ in rows], dtype=np.int64)
    known = slots is None or not chained.any()  # every position known here: sent as they are
    row_index = np.asarray([j for _, j in rows], dtype=np.int64)
    if known:  # the emitted tokens' positions and the draws' positions, in place of the starts and offsets
        starts, offsets = starts + offsets + row_index, verify_row_positions(starts + offsets, row_index)
    host = np.concatenate([
        starts, offsets, chained, row_index,
        np.asarray([chunk.slot for chunk, _ in rows], dtype=np.int64),
        np.asarray([min(j, len(chunk.drafts) - 1) if chunk.drafts else 0 for chunk, j in rows], dtype=np.int64),
        np.asarray([as_int64(chunk.request.seed) for chunk, _ in rows], dtype=np.int64),
        np.asarray([chunk.request.top_k for chunk, _ in rows], dtype=np.int64),
        np.asarray([chunk.drafts[j] if j < len(chunk.drafts) else -1 for chunk, j in rows], dtype=np.int64),
        np.asarray([p.temperature for p in params] + [p.top_p for p in params], dtype=np.float32).view(np.int64),
        first, np.asarray([chunk.slot for chunk in chunks], dtype=np.int64), verify_rows.reshape(-1),
        np.asarray(verify, dtype=np.int64)])
    moved = runtime.upload(host)
    start, offset, chained, row, slot, column, seeds, top_k, drafts = moved[:9 * count].view(9, count)
    temperature, top_p = moved[9 * count:10 * count].view(torch.float32).view(2, count)  # float32 pairs in int64s
    chunk_first, chunk_slot = moved[10 * count:10 * count + 2 * n].view(2, n)
    chunk_verify = moved[10 * count + 2 * n:10 * count + 2 * n + verify_rows.size].view(verify_rows.shape)
    index = moved[10 * count + 2 * n + verify_rows.size:]
    if slots is not None and verify:
        drafts = torch.where(drafts >= 0, drafts, slots.drafts[slot, column])
    if known:
        positions, draws = start, offset  # the emitted token's position; the draw's
    else:
        base = torch.where(chained > 0, slots.length[slot], start) + offset
        positions, draws = base + row, verify_row_positions(base, row)
    vocab = logits.shape[-1]
    filters = any(chunk.request.params.temperature > 0 and (0 < chunk.request.top_k < vocab
                                                             or chunk.request.params.top_p < 1) for chunk, _ in rows)
    fresh, target = ops.sample(logits, temperature, top_p, top_k, seeds, draws, filters=filters,
                               filter_order=filter_order)
    tokens = fresh
    if not verify:  # one row per chunk, its final one
        if slots is not None:
            slots.last.index_copy_(0, chunk_slot, tokens)
            slots.length.index_copy_(0, chunk_slot, positions)
        if all(p.logprobs is None for p in params):
            return PendingEmissions(chunks, runtime.start_download(tokens), 0)
    accepted = torch.zeros(count, dtype=torch.bool, device=device)
    exact = torch.zeros(count, dtype=torch.float64, device=device)
    if verify:
        draft_logprobs = torch.stack([rows[i][0].request.draft_logprobs[rows[i][1]] for i in verify]).to(device)
        ok, again = ops.speculative_accept(target[index], draft_logprobs, drafts[index], seeds[index], draws[index])
        tokens = tokens.index_put((index,), torch.where(ok, drafts[index], again))
        accepted = accepted.index_put((index,), ok)
        exact = exact.index_put((index,), acceptance_probability(target[index], draft_logprobs))
    if slots is not None and verify:
        flags = torch.cat((accepted, accepted.new_zeros(1)))[chunk_verify]
        final = chunk_first + flags.long().cumprod(dim=1).sum(dim=1)
        slots.last.index_copy_(0, chunk_slot, tokens[final])
        slots.length.index_copy_(0, chunk_slot, positions[final])
    columns = [tokens.double(), accepted.double(), exact, target.gather(1, tokens[:, None])[:, 0].double()]
    top = max((p.logprobs or 0 for p in params if p.logprobs is not None), default=0)
    if top:
        values, ids = target.topk(top, dim=-1)
        columns += [values.double().T, ids.double().T]
    return PendingEmissions(chunks, runtime.start_download(torch.cat([c.reshape(-1, count) for c in columns])), top)


def _emissions(chunks, result: np.ndarray, top: int) -> list[Emission]:
    tokens, accepted, exact, chosen = result[0].astype(np.int64), result[1] > 0, result[2], result[3]
    values, ids = result[4:4 + top], result[4 + top:4 + 2 * top].astype(np.int64)
    out, row = [], 0
    for chunk in chunks:
        drafts, count = chunk.drafts, chunk.request.params.logprobs
        emission = Emission([], [], drafted=len(drafts))
        emission.calibration_errors = [abs(float(exact[row + j]) - c)
                                       for j, c in enumerate(chunk.request.draft_confidences[:len(drafts)])]
        for j in range(len(drafts) + 1):
            i = row + j
            verified = j < len(drafts) and bool(accepted[i])
            token = int(tokens[i])
            emission.accepted += verified
            emission.tokens.append(token)
            if count is None:
                emission.logprobs.append(None)
            else:
                logprobs = {int(ids[n, i]): float(values[n, i]) for n in range(count)}
                logprobs[token] = float(chosen[i])
                emission.logprobs.append(logprobs)
            if not verified:
                break
        out.append(emission)
        row += len(drafts) + 1
    return out
