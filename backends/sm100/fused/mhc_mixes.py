"""The mHC mixing weights of a block of tokens in one Triton kernel: the scaled and biased
pre and post gates, and the stream-mixing matrix through its softmax and every Sinkhorn
iteration, in registers (the reference's arithmetic, float32, in the same order)."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_TOKENS = 64


@triton.jit
def mhc_mixes_kernel(mixes, scale, base, pre, post, comb, tokens, stride, hc_eps,
                     HC: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens ``[BLOCK * pid, BLOCK * (pid + 1))``: ``mixes`` float32 ``[tokens, HC * (2 + HC)]``
    (row stride ``stride``) to ``pre``, ``post`` ``[tokens, HC]`` and ``comb`` ``[tokens, HC, HC]``,
    with ``ITERS`` Sinkhorn iterations."""
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = token < tokens
    stream = tl.arange(0, HC)
    row = mixes + token[:, None] * stride + stream[None, :]
    gate = token[:, None] * HC + stream[None, :]
    m_pre = tl.load(row, mask=live[:, None], other=0.0)
    m_post = tl.load(row + HC, mask=live[:, None], other=0.0)
    p = tl.sigmoid(tl.load(scale) * m_pre + tl.load(base + stream)[None, :]) + hc_eps
    q = 2.0 * tl.sigmoid(tl.load(scale + 1) * m_post + tl.load(base + HC + stream)[None, :])
    tl.store(pre + gate, p, mask=live[:, None])
    tl.store(post + gate, q, mask=live[:, None])

    cell = stream[:, None] * HC + stream[None, :]
    logits = tl.load(mixes + token[:, None, None] * stride + 2 * HC + cell[None, :, :], mask=live[:, None, None],
                     other=0.0)
    logits = tl.load(scale + 2) * logits + tl.load(base + 2 * HC + cell)[None, :, :]
    shifted = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    matrix = shifted / tl.sum(shifted, axis=2)[:, :, None] + hc_eps
    for _ in range(ITERS):
        matrix = matrix / (tl.sum(matrix, axis=1)[:, None, :] + hc_eps)
        matrix = matrix / (tl.sum(matrix, axis=2)[:, :, None] + hc_eps)
    tl.store(comb + token[:, None, None] * (HC * HC) + cell[None, :, :], matrix, mask=live[:, None, None])
