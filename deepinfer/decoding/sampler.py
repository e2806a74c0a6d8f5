"""Turning a step's logits into emitted tokens: plain sampling, or DSpark verification."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.hal.ops.speculative import acceptance_probability
from deepinfer.hal.registry import OpTable


@dataclass
class Emission:
    """What one request emits in a step: tokens (accepted drafts, then the final row's token),
    their top log-probabilities when asked, and verification statistics."""

    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    drafted: int = 0
    accepted: int = 0
    calibration_errors: list[float] = field(default_factory=list)


def emit(ops: OpTable, chunks, logits: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[Emission]:
    """``logits`` holds, for each sampling chunk in order, one row per verified draft plus the
    final row. Draws are keyed by (seed, position of the emitted token), so they do not depend
    on the rest of the batch. ``masks`` (grammar bitmasks and their rows) are applied first, so
    sampling, verification and logprobs all see the constrained distribution."""
    rows = [(chunk, j) for chunk in chunks for j in range(len(chunk.drafts) + 1)]
    if not rows:
        return []
    device = logits.device
    if masks is not None:
        logits = ops.apply_token_bitmask(logits, masks[0].to(device), masks[1].to(device))
    params = [chunk.request.params for chunk, _ in rows]
    first_row = {id(chunk): chunk.start + len(chunk.token_ids) - len(chunk.drafts) for chunk in chunks}
    positions = torch.tensor([first_row[id(chunk)] + j for chunk, j in rows], dtype=torch.int64, device=device)
    seeds = torch.tensor([_as_int64(chunk.request.seed) for chunk, _ in rows], dtype=torch.int64, device=device)
    fresh, target = ops.sample(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        seeds, positions)
    verify = [i for i, (chunk, j) in enumerate(rows) if j < len(chunk.drafts)]
    accepted, resampled, exact = {}, {}, {}
    if verify:
        index = torch.tensor(verify, device=device)
        draft_ids = torch.tensor([rows[i][0].drafts[rows[i][1]] for i in verify], dtype=torch.int64, device=device)
        draft_logprobs = torch.stack([rows[i][0].request.draft_logprobs[rows[i][1]] for i in verify]).to(device)
        ok, again = ops.speculative_accept(target[index], draft_logprobs, draft_ids, seeds[index], positions[index])
        probabilities = acceptance_probability(target[index], draft_logprobs).tolist()
        for k, i in enumerate(verify):
            accepted[i], resampled[i], exact[i] = bool(ok[k]), int(again[k]), probabilities[k]
    fresh_ids = fresh.tolist()
    out, row = [], 0
    for chunk in chunks:
        drafts, count = chunk.drafts, chunk.request.params.logprobs
        emission = Emission([], [], drafted=len(drafts))
        emission.calibration_errors = [abs(exact[row + j] - c)
                                       for j, c in enumerate(chunk.request.draft_confidences[:len(drafts)])]
        for j in range(len(drafts) + 1):
            i = row + j
            verified = j < len(drafts) and accepted[i]
            token = drafts[j] if verified else resampled[i] if j < len(drafts) else fresh_ids[i]
            emission.accepted += verified
            emission.tokens.append(token)
            emission.logprobs.append(_top_logprobs(target[i], token, count) if count is not None else None)
            if not verified:
                break
        out.append(emission)
        row += len(drafts) + 1
    return out


def _as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _top_logprobs(row: torch.Tensor, chosen: int, count: int) -> dict[int, float]:
    values, ids = row.topk(count) if count else (row[:0], row[:0].long())
    out = {int(i): float(v) for i, v in zip(ids, values)}
    out[chosen] = float(row[chosen])
    return out
