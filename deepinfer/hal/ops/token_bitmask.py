"""Grammar masks: a packed bitmask of allowed tokens applied to logits before sampling."""
from __future__ import annotations

import sys

import numpy as np
import torch

from deepinfer.hal.spec import OpCase, OpSpec, Tolerance, register

NEG_INF_BITS = -8388608
"""0xFF800000 as int32: the bit pattern of float32 -inf."""
COLUMN_BLOCK = 8192
"""Tokens unpacked per pass on the CPU (the working set stays in cache)."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set every token a row's mask disallows to ``-inf``, in place; returns ``logits``.

    ``logits`` float32 ``[N, V]``; ``bitmask`` int32 ``[M, ceil(V / 32)]`` where bit ``t % 32``
    (least significant first) of word ``t // 32`` set means token ``t`` is allowed (xgrammar's
    layout); ``rows`` int64 ``[M]``, distinct, names the logits row of each mask (default: mask
    ``i`` is row ``i``, ``M == N``). The op adds ``0.0`` or ``-inf``, so allowed logits keep
    their value (a ``-0.0`` may become ``+0.0``)."""
    _check(logits, bitmask, rows)
    if not bitmask.shape[0]:
        return logits
    if rows is not None and 2 * rows.numel() >= logits.shape[0]:  # mostly masked: every row, no gather
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        full[rows.to(bitmask.device)] = bitmask
        bitmask, rows = full, None
    target = logits if rows is None else logits[rows]
    if logits.device.type == "cpu" and sys.byteorder == "little":
        _mask_cpu(target, bitmask)
    else:
        _mask_shifts(target, bitmask)
    if rows is not None:
        logits[rows] = target
    return logits


def _mask_shifts(target: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Any device: shift each word's 32 bits out, turn 1/0 into 0.0/-inf bit patterns, add."""
    shifts = torch.arange(32, dtype=torch.int32, device=target.device)
    bits = (bitmask.to(target.device)[..., None] >> shifts) & 1
    target.add_(((bits - 1) & NEG_INF_BITS).view(torch.float32).flatten(1)[:, :target.shape[1]])


def _mask_cpu(target: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Column blocks: unpack the bits (numpy), turn 1/0 into 0.0/-inf bit patterns, add."""
    packed, vocab = bitmask.contiguous().numpy().view(np.uint8), target.shape[1]
    for start in range(0, vocab, COLUMN_BLOCK):
        end = min(start + COLUMN_BLOCK, vocab)
        bits = np.unpackbits(packed[:, start // 8:(end + 7) // 8], axis=1, bitorder="little")[:, :end - start]
        additive = torch.from_numpy(bits).to(torch.int32).sub_(1).bitwise_and_(NEG_INF_BITS).view(torch.float32)
        target[:, start:end].add_(additive)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.ndim != 2 or logits.dtype != torch.float32:
        raise ValueError(f"apply_token_bitmask expects float32 logits [N, V]; got {logits.dtype} {tuple(logits.shape)}")
    words = bitmask_words(logits.shape[1])
    if bitmask.dtype != torch.int32 or bitmask.ndim != 2 or bitmask.shape[1] != words:
        raise ValueError(f"bitmask must be int32 [M, {words}] (ceil(V / 32) words for V={logits.shape[1]}); "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"without rows, the bitmask needs one row per logits row ({logits.shape[0]}); "
                             f"got {bitmask.shape[0]}")
        return
    if rows.ndim != 1 or rows.shape[0] != bitmask.shape[0] or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [{bitmask.shape[0]}] (one logits row per mask); got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]
                         or rows.unique().numel() != rows.numel()):
        raise ValueError(f"rows must be distinct logits rows in [0, {logits.shape[0]}); got {rows.tolist()}")


def random_bitmask(rows: int, vocab: int, allowed: float, gen: torch.Generator) -> torch.Tensor:
    """An int32 bitmask with each token allowed with probability ``allowed``."""
    keep = torch.rand(rows, bitmask_words(vocab) * 32, generator=gen) < allowed
    words = (keep.view(rows, -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _case(rows: int, vocab: int, masked: list[int] | None, allowed: float):
    def make(gen: torch.Generator, device: torch.device):
        count = rows if masked is None else len(masked)
        args = {"logits": (4 * torch.randn(rows, vocab, generator=gen)).to(device),
                "bitmask": random_bitmask(count, vocab, allowed, gen).to(device)}
        if masked is not None:
            args["rows"] = torch.tensor(masked, dtype=torch.int64, device=device)
        return args
    return make


register(OpSpec(
    name="apply_token_bitmask",
    summary="grammar bitmask (xgrammar layout) applied to logits rows, in place: disallowed -> -inf",
    reference=apply_token_bitmask,
    cases=(
        OpCase("tiny", _case(5, 100, None, 0.5)),
        OpCase("tiny_rows", _case(9, 77, [7, 0, 3], 0.3)),
        OpCase("tiny_most_rows", _case(6, 200, [5, 0, 2, 3], 0.4)),
        OpCase("tiny_sparse", _case(4, 2048, None, 0.01)),
        OpCase("v41_batch16", _case(16, 129280, None, 0.5), size="real"),
        OpCase("v41_drafts", _case(48, 129280, list(range(0, 48, 2)), 0.9), size="real"),
    ),
    tolerances={torch.float32: Tolerance(0.0, 0.0)},
))
