"""A grammar bitmask applied to logits in one Triton kernel: each program reads a block of one
mask row's words once, unpacks their 32 bits (least significant first) and stores ``-inf`` at the
disallowed tokens only; allowed logits are neither read nor written."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_WORDS = 64
"""Mask words (of 32 tokens each) per program."""


@triton.jit
def token_bitmask_kernel(logits, bitmask, rows, vocab, words, row_stride, column_stride, HAS_ROWS: tl.constexpr,
                         BLOCK_WORDS: tl.constexpr):
    """Words ``[BLOCK_WORDS * pid1, ...)`` of mask row ``m = pid0`` (``bitmask [M, words]``):
    logits row ``rows[m]`` (``m`` without ``HAS_ROWS``) gets ``-inf`` at each token ``< vocab``
    whose bit is 0."""
    mask_row = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    bits = tl.load(bitmask + mask_row * words + word, mask=word < words, other=-1)
    bit = tl.arange(0, 32)
    token = word[:, None] * 32 + bit[None, :]
    banned = (((bits[:, None] >> bit[None, :]) & 1) == 0) & (token < vocab)
    target = mask_row
    if HAS_ROWS:
        target = tl.load(rows + mask_row)
    tl.store(logits + target * row_stride + token.to(tl.int64) * column_stride,
             tl.full((BLOCK_WORDS, 32), float("-inf"), tl.float32), mask=banned)


def main() -> None:
    """Check the bitmask kernel against the OpSpec reference on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("apply_token_bitmask")


if __name__ == "__main__":
    main()
