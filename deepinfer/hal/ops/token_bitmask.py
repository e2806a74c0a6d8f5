"""Grammar masks: a packed bitmask of allowed tokens applied to logits before sampling."""
from __future__ import annotations

import functools
import logging
import sys

import torch

from deepinfer.hal.spec import OpCase, OpSpec, Tolerance, register
from deepinfer.hal.value_checks import value_checks

NEG_INF_BITS = -8388608
"""0xFF800000 as int32: the bit pattern of float32 -inf."""
logger = logging.getLogger(__name__)
_COMPILE_FAILED = False
SPARSE_SHARE = 8
"""A row whose words needing work are at most 1/SPARSE_SHARE of all is handled token by token."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set every token a row's mask disallows to ``-inf``, in place; returns ``logits``.

    ``logits`` float32 ``[N, V]``; ``bitmask`` int32 ``[M, ceil(V / 32)]`` where bit ``t % 32``
    (least significant first) of word ``t // 32`` set means token ``t`` is allowed (xgrammar's
    layout); ``rows`` int64 ``[M]``, distinct, names the logits row of each mask (default: mask
    ``i`` is row ``i``, ``M == N``). Allowed logits keep their value, except that a dense row
    (below) may turn ``-0.0`` into ``+0.0``.

    On a CPU the op runs as one fused loop compiled by ``torch.compile`` (the first call compiles
    for seconds; a failed compile is logged once and the eager path below takes over). Eagerly,
    grammar masks being mostly extreme, the work follows the mask: a row with few disallowed
    tokens (at most 1/8 of its words not all-ones) writes ``-inf`` at those tokens only; a row
    with few allowed tokens keeps those values and fills the rest; any other row adds ``0.0`` or
    ``-inf`` to every logit. Where reading the mask on the host would cost a device sync (off a
    CPU, or inside an engine step: value checks off) every row takes that dense path."""
    check_bitmask_args(logits, bitmask, rows)
    if not bitmask.shape[0]:
        return logits
    if logits.device.type == "cpu" and not _COMPILE_FAILED and _compiled_kernel() is not None:
        full = bitmask
        if rows is not None:  # the other rows all-allowed
            full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
            full[rows] = bitmask
        if _run_compiled(logits, full):
            return logits
    device = logits.device
    bitmask = bitmask.to(device)
    rows = torch.arange(bitmask.shape[0], device=device) if rows is None else rows.to(device)
    if device.type != "cpu" or not value_checks():
        _mask_dense(logits, bitmask, rows)
        return logits
    has_banned, has_allowed = bitmask != -1, bitmask != 0
    words = bitmask.shape[1]
    few_banned = has_banned.sum(1) * SPARSE_SHARE <= words
    few_allowed = ~few_banned & (has_allowed.sum(1) * SPARSE_SHARE <= words)
    dense = ~(few_banned | few_allowed)
    if bool(few_banned.any()):
        mask_rows, tokens = _tokens_with_bit(bitmask, has_banned & few_banned[:, None], 0, logits.shape[1])
        logits[rows[mask_rows], tokens] = float("-inf")
    if bool(few_allowed.any()):
        mask_rows, tokens = _tokens_with_bit(bitmask, has_allowed & few_allowed[:, None], 1, logits.shape[1])
        kept = logits[rows[mask_rows], tokens]
        for row in rows[few_allowed].tolist():  # row by row: contiguous fills beat index_fill_
            logits[row].fill_(float("-inf"))
        logits[rows[mask_rows], tokens] = kept
    if bool(dense.any()):
        _mask_dense(logits, bitmask[dense], rows[dense])
    return logits


def _masked_fill(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """What the compiled kernel computes: unpack every bit, fill the disallowed logits."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


@functools.lru_cache(maxsize=1)
def _compiled_kernel():
    """``torch.compile`` of :func:`_masked_fill` (dynamic shapes), or None when it cannot exist."""
    if not hasattr(torch, "compile"):
        return None
    return torch.compile(_masked_fill, dynamic=True)


def _run_compiled(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Run the compiled kernel; False (and the eager path from now on) if compiling fails."""
    global _COMPILE_FAILED
    try:
        _compiled_kernel()(logits, bitmask)
        return True
    except Exception as err:  # no C++ compiler, an inductor bug: the eager path is exact too
        _COMPILE_FAILED = True
        logger.warning("apply_token_bitmask: torch.compile failed (%s: %s); using the eager path",
                       type(err).__name__, err)
        return False


def _tokens_with_bit(bitmask: torch.Tensor, words: torch.Tensor, bit: int, vocab: int):
    """``(mask row, token)`` of every token below ``vocab`` whose bit is ``bit``, looking only at
    the words selected by the bool ``words [M, W]``."""
    mask_rows, word = torch.nonzero(words, as_tuple=True)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[mask_rows, word][:, None] >> shifts) & 1
    tokens = word[:, None] * 32 + shifts
    pick = (bits == bit) & (tokens < vocab)
    return mask_rows[:, None].expand_as(tokens)[pick], tokens[pick]


def _mask_dense(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Every logit of ``rows`` gets 0.0 or -inf added. When they are most of the rows, all rows
    take part (the others all-allowed) and no row is gathered."""
    if 2 * rows.numel() >= logits.shape[0]:
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        full[rows] = bitmask
        _add_mask(logits, full)
    else:
        target = logits[rows]
        _add_mask(target, bitmask)
        logits[rows] = target


def _add_mask(target: torch.Tensor, bitmask: torch.Tensor) -> None:
    if sys.byteorder == "little":
        _mask_bytes(target, bitmask)
    else:
        _mask_shifts(target, bitmask)


def _mask_shifts(target: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Big-endian hosts: shift each word's 32 bits out, turn 1/0 into 0.0/-inf bit patterns, add."""
    shifts = torch.arange(32, dtype=torch.int32, device=target.device)
    bits = (bitmask.to(target.device)[..., None] >> shifts) & 1
    target.add_(((bits - 1) & NEG_INF_BITS).view(torch.float32).flatten(1)[:, :target.shape[1]])


def _mask_bytes(target: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Little-endian words read as bytes; each byte looks up its 8 additive values (0.0 or -inf,
    least significant bit first) in a 256 x 8 table; one add."""
    table = _byte_table(target.device)
    additive = torch.nn.functional.embedding(bitmask.to(target.device).view(torch.uint8).long(), table)
    target.add_(additive.flatten(1)[:, :target.shape[1]])


@functools.lru_cache(maxsize=8)
def _byte_table(device: torch.device) -> torch.Tensor:
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device)


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
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
    if value_checks() and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]
                         or rows.unique().numel() != rows.numel()):
        raise ValueError(f"rows must be distinct logits rows in [0, {logits.shape[0]}); got {rows.tolist()}")


def random_bitmask(rows: int, vocab: int, allowed: float | tuple[float, ...], gen: torch.Generator) -> torch.Tensor:
    """An int32 bitmask with each token allowed with probability ``allowed`` (or, per row,
    ``allowed[row % len(allowed)]``)."""
    share = torch.tensor([allowed] if isinstance(allowed, float) else list(allowed))
    keep = torch.rand(rows, bitmask_words(vocab) * 32, generator=gen) < share[torch.arange(rows) % len(share), None]
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
    activations=False,
    summary="grammar bitmask (xgrammar layout) applied to logits rows, in place: disallowed -> -inf",
    reference=apply_token_bitmask,
    cases=(
        OpCase("tiny", _case(5, 100, None, 0.5)),
        OpCase("tiny_rows", _case(9, 77, [7, 0, 3], 0.3)),
        OpCase("tiny_most_rows", _case(6, 200, [5, 0, 2, 3], 0.4)),
        OpCase("tiny_sparse", _case(4, 2048, None, 0.01)),
        OpCase("tiny_extremes", _case(8, 3000, None, (0.0005, 0.9995, 0.5, 1.0, 0.0))),
        OpCase("tiny_extremes_rows", _case(9, 3000, [8, 1, 4, 0, 6], (0.9999, 0.001, 0.3))),
        OpCase("v41_batch16", _case(16, 129280, None, 0.5), size="real"),
        OpCase("v41_drafts", _case(48, 129280, list(range(0, 48, 2)), 0.9), size="real"),
        OpCase("v41_grammar_like", _case(64, 129280, None, (0.00005, 0.9999, 0.0002, 0.99995)), size="real"),
    ),
    tolerances={torch.float32: Tolerance(0.0, 0.0)},
))
