"""Candidate blocks, the first stage of DeepInfer's two-stage indexer top-k: the source layer
scores each block of ``block_size`` consecutive compressed keys by its best logit and keeps the
best ``blocks`` blocks; later layers score and select keys only inside them."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.indexer import _real_windows, check_windows, window_logits
from deepinfer.hal.spec import OpCase, OpSpec, register


def candidate_blocks(logits: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, block_size: int,
                     blocks: int) -> torch.Tensor:
    """bool ``[T, S]``: the columns of ``logits [T, S]`` (float32) in the blocks row ``t`` keeps.

    Row ``t``'s window is columns ``starts[t] .. starts[t] + lengths[t] - 1`` (int64, as
    :func:`~deepinfer.hal.ops.indexer.indexer_topk` takes them); block ``b`` is window offsets
    ``b * block_size .. (b + 1) * block_size - 1`` (the last one may be partial). A block's score
    is its highest logit, except the block holding the window's last column, which scores +inf
    (it is always kept). The ``blocks`` best scores are kept, a tie going to the lower block; a
    window of at most ``blocks`` blocks keeps them all. Columns outside the window are False."""
    check_windows(logits, starts, lengths, 1)
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not isinstance(block_size, int) or block_size < 1 or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"block_size and blocks must be ints >= 1, got {block_size!r} and {blocks!r}")
    tokens, width = logits.shape
    window, _ = window_logits(logits, starts, lengths)
    count = -(-width // block_size)
    padded = torch.nn.functional.pad(window, (0, count * block_size - width), value=float("-inf"))
    scores = padded.view(tokens, count, block_size).amax(dim=2)
    last = ((lengths - 1).clamp(min=0) // block_size)[:, None]
    block_ids = torch.arange(count, device=logits.device)
    scores = torch.where((block_ids == last) & (lengths[:, None] > 0), float("inf"), scores)
    ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :blocks]
    kept = torch.zeros(tokens, count, dtype=torch.bool, device=logits.device).scatter_(1, ranked, True)
    offset = torch.arange(width, device=logits.device) - starts[:, None]  # a column's offset in its window
    valid = (offset >= 0) & (offset < lengths[:, None])
    return valid & kept.gather(1, (offset.clamp(min=0) // block_size).clamp(max=max(count - 1, 0)))


def _case(width, starts, lengths, block_size, blocks, distinct_values=None):
    def make(gen: torch.Generator, device: torch.device):
        shape = (len(starts), width)
        logits = (torch.randint(0, distinct_values, shape, generator=gen).float() if distinct_values
                  else torch.randn(shape, generator=gen))
        return {"logits": logits.to(device), "starts": torch.tensor(starts, device=device),
                "lengths": torch.tensor(lengths, device=device), "block_size": block_size, "blocks": blocks}
    return make


register(OpSpec(
    name="candidate_blocks",
    activations=False,
    summary="the columns of the best-scoring blocks of each row's window (two-stage indexer top-k)",
    reference=candidate_blocks,
    cases=(
        OpCase("tiny", _case(40, [0, 3, 7, 0], [40, 30, 33, 5], 4, 3)),
        OpCase("tiny_ties", _case(24, [0, 2, 0], [24, 21, 17], 3, 2, distinct_values=3)),
        OpCase("tiny_short_and_empty", _case(16, [0, 4, 16], [16, 2, 0], 8, 1)),
        OpCase("v41_prefill", _case(2048, *_real_windows(16, 2048), 16, 64), "real"),
    ),
))
