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
from deepinfer.hal.ops.sampling import as_int64
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
        return _emissions(self.chunks, self._fetch().numpy(), self._top)


def emit(ops: OpTable, runtime: Runtime, chunks, logits: torch.Tensor,
         masks: tuple[torch.Tensor, torch.Tensor] | None = None,
         last_tokens: torch.Tensor | None = None) -> PendingEmissions:
    """Launch the sampling of a step. ``logits`` holds, for each sampling chunk in order, one
    row per verified draft plus the final row. Draws are keyed by (seed, position of the emitted
    token), so they do not depend on the rest of the batch. ``masks`` (grammar bitmasks and
    their rows) are applied first, so sampling, verification and logprobs all see the
    constrained distribution. ``last_tokens`` (int64, one entry per state slot): the token each
    chunk without drafts emits is written at its request's slot, where the next step's
    placeholder input reads it on the device. The ops skip their value checks (the engine
    validated every parameter on the host): reading a device value here would wait for the
    step's forward, which is what asynchronous scheduling overlaps with the host's work."""
    with skip_value_checks():
        return _emit(ops, runtime, chunks, logits, masks, last_tokens)


def _emit(ops: OpTable, runtime: Runtime, chunks, logits: torch.Tensor, masks, last_tokens) -> PendingEmissions:
    rows = [(chunk, j) for chunk in chunks for j in range(len(chunk.drafts) + 1)]
    if not rows:
        return PendingEmissions(chunks, None, 0)
    device = logits.device
    if masks is not None:
        logits = ops.apply_token_bitmask(logits, masks[0].to(device), masks[1].to(device))
    count = len(rows)
    params = [chunk.request.params for chunk, _ in rows]
    first_row = {id(chunk): chunk.start + len(chunk.token_ids) - len(chunk.drafts) for chunk in chunks}
    draft_ids = [chunk.drafts[j] if j < len(chunk.drafts) else -1 for chunk, j in rows]
    verify = [i for i, d in enumerate(draft_ids) if d >= 0]
    plain_rows, plain_slots, row = [], [], 0
    for chunk in chunks:
        if not chunk.drafts:
            plain_rows.append(row)
            plain_slots.append(chunk.slot)
        row += len(chunk.drafts) + 1
    if last_tokens is None:
        plain_rows, plain_slots = [], []
    host = np.concatenate([
        np.asarray([first_row[id(chunk)] + j for chunk, j in rows], dtype=np.int64),
        np.asarray([as_int64(chunk.request.seed) for chunk, _ in rows], dtype=np.int64),
        np.asarray([p.top_k for p in params], dtype=np.int64),
        np.asarray(draft_ids, dtype=np.int64),
        np.asarray([p.temperature for p in params], dtype=np.float64).view(np.int64),
        np.asarray([p.top_p for p in params], dtype=np.float64).view(np.int64),
        np.asarray(verify + plain_rows + plain_slots, dtype=np.int64)])
    moved = runtime.upload(host)
    positions, seeds, top_k, drafts = moved[:4 * count].view(4, count)
    temperature, top_p = moved[4 * count:6 * count].view(torch.float64).float().view(2, count)
    index = moved[6 * count:6 * count + len(verify)]
    plain = moved[6 * count + len(verify):].view(2, len(plain_rows))
    vocab = logits.shape[-1]
    filters = any(p.temperature > 0 and (0 < p.top_k < vocab or p.top_p < 1) for p in params)
    fresh, target = ops.sample(logits, temperature, top_p, top_k, seeds, positions, filters=filters)
    tokens = fresh
    accepted = torch.zeros(count, dtype=torch.bool, device=device)
    exact = torch.zeros(count, dtype=torch.float64, device=device)
    if verify:
        draft_logprobs = torch.stack([rows[i][0].request.draft_logprobs[rows[i][1]] for i in verify]).to(device)
        ok, again = ops.speculative_accept(target[index], draft_logprobs, drafts[index], seeds[index], positions[index])
        tokens = tokens.index_put((index,), torch.where(ok, drafts[index], again))
        accepted = accepted.index_put((index,), ok)
        exact = exact.index_put((index,), acceptance_probability(target[index], draft_logprobs))
    if plain_rows:
        last_tokens.index_copy_(0, plain[1], tokens[plain[0]])
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
