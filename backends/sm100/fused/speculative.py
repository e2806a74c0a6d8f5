"""Speculative verification in one Triton program per row, in the reference's float32 arithmetic:
the accept test from the draft token's two log-probabilities, then two passes over the vocabulary
(a third for a row whose residual is empty): the float64 sum of the residual
``max(exp(log q) - exp(log p - 5e-5), 0)``, block after block, and the resampled token, the first
of positive residual whose float64 prefix sum exceeds ``u * sum`` (a block-wise ``tl.cumsum`` that
stops at its block; a tree sum, where the reference sums left to right)."""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.hal.ops.sampling import CASE_ACCEPT, CASE_RESAMPLE
from deepinfer.hal.ops.speculative import DRAFT_LOGPROB_PENALTY
from deepinfer_backends.sm100.fused.sampling import draw_block, draw_uniform

BLOCK_VOCAB = 8192
NUM_WARPS = 16
PENALTY: tl.constexpr = tl.constexpr(DRAFT_LOGPROB_PENALTY)
ACCEPT: tl.constexpr = tl.constexpr(CASE_ACCEPT)
RESAMPLE: tl.constexpr = tl.constexpr(CASE_RESAMPLE)


@triton.jit
def _residual(target_row, draft_row, offs, inside, empty):
    """float64 ``max(exp(log q) - exp(log p - 5e-5), 0)`` at ``offs`` (float32 math), or ``q``
    when ``empty``; 0 past the row."""
    q = tl.exp(tl.load(target_row + offs, mask=inside, other=float("-inf")).to(tl.float32))
    lp = tl.load(draft_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
    shrunk = tl.exp(lp - tl.full([], PENALTY, tl.float32))
    return tl.where(empty, q, tl.maximum(q - shrunk, 0.0)).to(tl.float64)


@triton.jit
def _sum_pass(target_row, draft_row, vocab, empty, BLOCK: tl.constexpr):
    """The float64 sum of the row's residual (``q`` when ``empty``), block after block as the draw
    sums it, and its last token of positive residual."""
    total = tl.zeros([], tl.float64)
    last = tl.zeros([], tl.int32) - 1
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        residual = _residual(target_row, draft_row, offs, offs < vocab, empty)
        total += tl.sum(residual)
        last = tl.maximum(last, tl.max(tl.where(residual > 0, offs, -1)))
    return total, last


@triton.jit
def speculative_kernel(target, draft, draft_ids, seeds, positions, accepted, resampled, vocab, target_stride,
                       draft_stride, BLOCK: tl.constexpr):
    """Row ``pid`` of the HAL ``speculative_accept``: ``accepted[pid]`` (uint8) and ``resampled[pid]``."""
    row = tl.program_id(0).to(tl.int64)
    target_row = target + row * target_stride
    draft_row = draft + row * draft_stride
    draft_id = tl.load(draft_ids + row)
    index = tl.minimum(tl.maximum(draft_id, 0), vocab - 1)
    gap = tl.load(target_row + index).to(tl.float32) - tl.load(draft_row + index).to(tl.float32)
    ratio = tl.exp(tl.where(gap > 0, 0.0, gap))  # min(gap, 0), NaN (both -inf) kept: never accepted
    seed = tl.load(seeds + row)
    position = tl.load(positions + row)
    accept_uniform = draw_uniform(seed, position, ACCEPT, 0).to(tl.float32)
    tl.store(accepted + row, ((draft_id >= 0) & (ratio > accept_uniform)).to(tl.uint8))

    empty = tl.zeros([], tl.int1)
    total, last = _sum_pass(target_row, draft_row, vocab, empty, BLOCK)
    if total == 0:
        empty = total == 0
        total, last = _sum_pass(target_row, draft_row, vocab, empty, BLOCK)
    goal = draw_uniform(seed, position, RESAMPLE, 0) * total
    token = tl.zeros([], tl.int32) + vocab
    running = tl.zeros([], tl.float64)
    start = tl.zeros([], tl.int32)
    while (token == vocab) & (start < vocab):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        token, running = draw_block(_residual(target_row, draft_row, offs, inside, empty), offs, inside, running,
                                    goal, vocab)
        start += BLOCK
    token = tl.where(token == vocab, last, token)  # the block tree sums left no token past the goal
    tl.store(resampled + row, token.to(tl.int64))


def main() -> None:
    """Check the speculative-acceptance kernel against the OpSpec reference on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("speculative_accept")


if __name__ == "__main__":
    main()
