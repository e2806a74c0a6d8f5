"""Speculative verification in one Triton program per row, float64 math as the reference: the
accept test from the draft token's ``q`` and ``p``, then three passes over the vocabulary: the mass
of the residual ``max(q - alpha * p, 0)``, the sum of its fixed-point weights (int64, exact in any
order), and the resampled token (a block-wise ``tl.cumsum`` that stops at its block)."""
from __future__ import annotations

import sys

import triton
import triton.language as tl

from deepinfer.hal.ops.sampling import CASE_ACCEPT, CASE_RESAMPLE
from deepinfer.hal.ops.speculative import DRAFT_PROB_PENALTY
from deepinfer_backends.sm100.fused.sampling import FIXED_POINT_ONE, counter_uniform, draw_block

BLOCK_VOCAB = 8192
NUM_WARPS = 16
ALPHA: tl.constexpr = tl.constexpr(DRAFT_PROB_PENALTY)
TINY: tl.constexpr = tl.constexpr(sys.float_info.min)
ACCEPT: tl.constexpr = tl.constexpr(CASE_ACCEPT)
RESAMPLE: tl.constexpr = tl.constexpr(CASE_RESAMPLE)


@triton.jit
def _residual(target_row, draft_row, offs, inside):
    """``q`` and ``max(q - alpha * p, 0)`` (float64) at ``offs``; 0 past the row."""
    q = tl.exp(tl.load(target_row + offs, mask=inside, other=float("-inf")).to(tl.float64))
    p = tl.exp(tl.load(draft_row + offs, mask=inside, other=float("-inf")).to(tl.float64))
    return q, tl.maximum(q - tl.full([], ALPHA, tl.float64) * p, 0.0)


@triton.jit
def _weights(target_row, draft_row, offs, inside, mass):
    """Fixed-point weights ``floor(residual / mass * 2**31)``, or of ``q`` when ``mass`` is 0."""
    q, residual = _residual(target_row, draft_row, offs, inside)
    normalised = tl.where(mass > 0, residual / tl.maximum(mass, tl.full([], TINY, tl.float64)), q)
    return tl.floor(normalised * FIXED_POINT_ONE).to(tl.int64)


@triton.jit
def speculative_kernel(target, draft, draft_ids, seeds, positions, accepted, resampled, vocab, target_stride,
                       draft_stride, BLOCK: tl.constexpr):
    """Row ``pid`` of the HAL ``speculative_accept``: ``accepted[pid]`` (uint8) and ``resampled[pid]``."""
    row = tl.program_id(0).to(tl.int64)
    target_row = target + row * target_stride
    draft_row = draft + row * draft_stride
    draft_id = tl.load(draft_ids + row)
    index = tl.minimum(tl.maximum(draft_id, 0), vocab - 1)
    q_draft = tl.exp(tl.load(target_row + index).to(tl.float64))
    p_draft = tl.exp(tl.load(draft_row + index).to(tl.float64))
    ratio = tl.where(p_draft > 0, q_draft / tl.maximum(p_draft, tl.full([], TINY, tl.float64)),
                     tl.where(q_draft > 0, float("inf"), 0.0))
    seed = tl.load(seeds + row)
    position = tl.load(positions + row)
    accept_uniform = counter_uniform(seed, 3 * position + ACCEPT, 0)
    tl.store(accepted + row, ((draft_id >= 0) & (accept_uniform < tl.minimum(ratio, 1.0))).to(tl.uint8))

    lanes = tl.zeros([BLOCK], tl.float64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lanes += _residual(target_row, draft_row, offs, offs < vocab)[1]
    mass = tl.sum(lanes)
    weights = tl.zeros([BLOCK], tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        weights += _weights(target_row, draft_row, offs, offs < vocab, mass)
    weight_sum = tl.sum(weights)
    uniform = counter_uniform(seed, 3 * position + RESAMPLE, 0)
    goal = tl.floor(uniform * weight_sum.to(tl.float64)).to(tl.int64)
    token = tl.zeros([], tl.int32) + vocab
    running = tl.zeros([], tl.int64)
    start = tl.zeros([], tl.int32)
    while (token == vocab) & (start < vocab):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        token, running = draw_block(_weights(target_row, draft_row, offs, inside, mass), offs, inside, running,
                                    goal, vocab)
        start += BLOCK
    tl.store(resampled + row, token.to(tl.int64))


def main() -> None:
    """Check the speculative-acceptance kernel against the OpSpec reference on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("speculative_accept")


if __name__ == "__main__":
    main()
