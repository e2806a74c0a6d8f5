"""The MoE gate in one Triton kernel, ``BLOCK_T`` tokens per program, each row held in registers:
``sqrt(softplus(logit))`` scores, then ``TOP_K`` rounds that take the row's largest packed key
(the selection value's order-preserving bits above the reversed expert id, so equal values go
to the lower id) and retire it, then the picked scores normalised in pick order.

Softplus follows torch (``x`` above 20, else ``log1p(exp(x))``) with libdevice's ``expf`` and
``log1pf`` on the GPU, the functions torch's CUDA kernel calls; Triton's interpreter has no
libdevice, so there ``log1p`` is computed from ``tl.log``."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.hal.ops import routing

ROW_ELEMENTS = 2048
MAX_BLOCK_T = 16
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
WEIGHT_SUM_EPS = tl.constexpr(routing.WEIGHT_SUM_EPS)


def block_tokens(block_e: int) -> int:
    """Rows per program for ``BLOCK_E``-wide rows: about ``ROW_ELEMENTS`` logits, 1 to ``MAX_BLOCK_T`` rows."""
    return max(1, min(MAX_BLOCK_T, ROW_ELEMENTS // block_e))


@triton.jit
def _score(x, LIBDEVICE: tl.constexpr):
    """``sqrt(softplus(x))`` for float32 ``x``, softplus as torch computes it."""
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(x))
    else:
        grown = tl.exp(x)
        shifted = 1.0 + grown
        soft = tl.where(shifted == 1.0, grown, tl.log(shifted) * (grown / (shifted - 1.0)))
    return tl.sqrt_rn(tl.where(x > SOFTPLUS_THRESHOLD, x, soft))


@triton.jit
def _order_bits(value):
    """Float32 ``value`` as a uint32 whose order is torch's sort order (NaN largest, -0.0 equal to 0.0)."""
    bits = tl.where(value == 0.0, 0.0, value).to(tl.uint32, bitcast=True)
    ordered = tl.where(bits >= 0x80000000, ~bits, bits | 0x80000000)
    return tl.where(value != value, 0xFFFFFFFF, ordered)


@triton.jit
def gate_rows(logits, bias, row, live, experts, row_stride, routed_scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
              HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The gate of rows ``row`` (``live`` where they exist) of ``logits``: ``(ids int64, weights
    float32)``, both ``[len(row), K_PAD]``, slot ``j < TOP_K`` holding the ``j``-th pick."""
    col = tl.arange(0, BLOCK_E)
    inside = col < experts
    row_logits = logits + row.to(tl.int64) * row_stride
    x = tl.load(row_logits[:, None] + col[None, :], mask=live[:, None] & inside[None, :], other=0.0).to(tl.float32)
    selection = _score(x, LIBDEVICE)
    if HAS_BIAS:
        selection += tl.load(bias + col, mask=inside, other=0.0).to(tl.float32)[None, :]
    reversed_col = (BLOCK_E - 1 - col).to(tl.uint64)
    key = (_order_bits(selection).to(tl.uint64) << 32) | reversed_col[None, :]
    key = tl.where(inside[None, :], key, 0)
    slot = tl.arange(0, K_PAD)
    picked_ids = tl.zeros((row.shape[0], K_PAD), tl.int64)
    picked_scores = tl.zeros((row.shape[0], K_PAD), tl.float32)
    total = tl.zeros((row.shape[0],), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        pick = (BLOCK_E - 1) - (best & 0xFFFFFFFF).to(tl.int32)
        key = tl.where(col[None, :] == pick[:, None], 0, key)
        score = _score(tl.load(row_logits + pick, mask=live, other=0.0).to(tl.float32), LIBDEVICE)
        total += score
        picked_ids = tl.where(slot[None, :] == j, pick.to(tl.int64)[:, None], picked_ids)
        picked_scores = tl.where(slot[None, :] == j, score[:, None], picked_scores)
    return picked_ids, tl.div_rn(picked_scores, (total + WEIGHT_SUM_EPS)[:, None]) * routed_scale


@triton.jit
def moe_gate_kernel(logits, bias, weights, ids, tokens, experts, row_stride, routed_scale,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Rows ``[BLOCK_T * pid, BLOCK_T * (pid + 1))`` of ``logits [tokens, experts]``: ``ids [tokens,
    TOP_K]`` (int64) the experts with the largest ``score + bias`` (ties to the lower id), largest
    first; ``weights`` (float32) their scores over ``(sum + 1e-20)``, times ``routed_scale``."""
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = row < tokens
    picked_ids, share = gate_rows(logits, bias, row, live, experts, row_stride, routed_scale, TOP_K, K_PAD, HAS_BIAS,
                                  BLOCK_E, LIBDEVICE)
    slot = tl.arange(0, K_PAD)
    out = row.to(tl.int64)[:, None] * TOP_K + slot[None, :]
    stored = live[:, None] & (slot < TOP_K)[None, :]
    tl.store(ids + out, picked_ids, mask=stored)
    tl.store(weights + out, share, mask=stored)


def main() -> None:
    """Check the MoE gate kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("moe_gate")


if __name__ == "__main__":
    main()
