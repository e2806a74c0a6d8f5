"""The mHC mixes in two Triton kernels, float32 throughout.

:func:`mhc_mix_partials`: each program takes ``BLOCK_TOKENS`` tokens and one ``SPLIT``-wide
slice of the flattened residual, and writes that slice's dot products with every row of ``fn``
and its sum of squares. A bf16 residual meets ``fn`` split into three bf16 parts
(``hi + mid + lo``, which hold a float32's 24 bits): each part's products with the bf16 values
are exact in float32, and the three go into one float32 accumulator, so bf16 tensor cores give
float32's precision. A float32 residual meets ``fn`` itself, as three TF32 products (``tf32x3``).
:func:`mhc_mixes_kernel` (or :func:`mhc_head_kernel`) adds the slices up in order, normalises by
the RMS, and computes the gates and the stream-mixing matrix through its softmax and every
Sinkhorn iteration, in registers. Tiles and slices are fixed by the widths alone, so each
token's arithmetic does not depend on the batch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 64
SPLIT = 256
BLOCK_K = 64
FINISH_TOKENS = 4
FINISH_WARPS = 1
"""Tiles of the two kernels, the same at every token count (so each token's arithmetic is): the
partials take ``BLOCK_TOKENS`` tokens and a ``SPLIT``-wide slice a program, the finishing kernels
``FINISH_TOKENS`` tokens with ``FINISH_WARPS`` warps (their Sinkhorn loop is latency-bound, so
one warp on a few tokens). Chosen side by side with ``experiments/mhc_mixes_tiles.py`` at one and
at 8192 tokens (``experiments/results/mhc_mixes_tiles_h200.csv``)."""


def bf16_parts(fn: torch.Tensor) -> torch.Tensor:
    """bf16 ``[3, rows, width]`` whose sum is float32 ``fn [rows, width]``: each part the bf16
    rounding of what the earlier ones leave."""
    parts, rest = [], fn.detach().float()
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return torch.stack(parts).contiguous()


@triton.jit
def mhc_mix_partials(x, fn, dots, squares, tokens, width, rows, x_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr, UPCAST: tl.constexpr):
    """Tokens ``[BLOCK * pid0, BLOCK * (pid0 + 1))`` of ``x [tokens, width]`` (row stride
    ``x_stride``), columns ``[SPLIT * pid1, SPLIT * (pid1 + 1))``: ``dots[pid1, token, r] =
    x[token, cols] . fn[r, cols]`` for the ``rows`` rows of ``fn`` (padded to ``ROWS``) and
    ``squares[pid1, token]``. ``PARTS`` 3: bf16 ``x`` and ``fn`` the bf16 parts ``[3, rows,
    width]`` of :func:`bf16_parts`; 1: float32 ``x`` and ``fn [rows, width]``. ``UPCAST`` feeds
    the bf16 parts to ``tl.dot`` as float32 (the same exact products; for Triton's interpreter)."""
    split = tl.program_id(1)
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = token < tokens
    row = tl.arange(0, ROWS)
    dot = tl.zeros((BLOCK, ROWS), tl.float32)
    square = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, SPLIT, BLOCK_K):
        col = split * SPLIT + start + tl.arange(0, BLOCK_K)
        inside = col < width
        a = tl.load(x + token[:, None].to(tl.int64) * x_stride + col[None, :], mask=live[:, None] & inside[None, :],
                    other=0.0)
        wide = a.to(tl.float32)
        square += tl.sum(wide * wide, axis=1)
        for part in tl.static_range(PARTS):
            b = tl.load(fn + part * rows * width + row[:, None] * width + col[None, :],
                        mask=(row[:, None] < rows) & inside[None, :], other=0.0)
            if PARTS == 1:
                dot = tl.dot(wide, tl.trans(b), dot, input_precision="tf32x3")
            elif UPCAST:
                dot = tl.dot(wide, tl.trans(b.to(tl.float32)), dot, input_precision="ieee")
            else:
                dot = tl.dot(a, tl.trans(b), dot)
    slot = split * tokens + token
    tl.store(dots + slot[:, None].to(tl.int64) * ROWS + row[None, :], dot, mask=live[:, None])
    tl.store(squares + slot, square, mask=live)


@triton.jit
def _summed(parts, offsets, mask, SPLITS: tl.constexpr, split_stride):
    """``sum_s parts[s * split_stride + offsets]``, the slices added in order (read past L1:
    other programs of the launch may have written them)."""
    total = tl.load(parts + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLITS):
        total += tl.load(parts + s * split_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _inverse_rms(squares, token, live, tokens, SPLITS: tl.constexpr, width, norm_eps):
    return tl.rsqrt(_summed(squares, token, live, SPLITS, tokens) / width + norm_eps)


@triton.jit
def mhc_mixes_kernel(dots, squares, scale, base, pre, post, comb, tokens, width, norm_eps, hc_eps, SPLITS: tl.constexpr,
                     HC: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
                     COLUMN_ROW: tl.constexpr = False):
    """Tokens ``[BLOCK * pid, BLOCK * (pid + 1))``: the partials of :func:`mhc_mix_partials` to
    ``pre``, ``post`` ``[tokens, HC]`` and ``comb`` ``[tokens, HC, HC]``, with ``ITERS`` Sinkhorn
    iterations in DeepInfer's order (``COLUMN_ROW``: the ``column_row`` order; the reference's
    arithmetic and order)."""
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _finish_mixes(dots, squares, scale, base, pre, post, comb, token, tokens, width, norm_eps, hc_eps, SPLITS, HC,
                  ROWS, ITERS, COLUMN_ROW)


@triton.jit
def _finish_mixes(dots, squares, scale, base, pre, post, comb, token, tokens, width, norm_eps, hc_eps,
                  SPLITS: tl.constexpr, HC: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr,
                  COLUMN_ROW: tl.constexpr):
    """``pre``, ``post`` and ``comb`` of the tokens ``token`` (a vector) from the partials."""
    live = token < tokens
    stride = tokens * ROWS
    inv = _inverse_rms(squares, token, live, tokens, SPLITS, width, norm_eps)
    stream = tl.arange(0, HC)
    row = token[:, None] * ROWS + stream[None, :]
    gate = token[:, None] * HC + stream[None, :]
    m_pre = _summed(dots, row, live[:, None], SPLITS, stride) * inv[:, None]
    m_post = _summed(dots, row + HC, live[:, None], SPLITS, stride) * inv[:, None]
    p = tl.sigmoid(tl.load(scale) * m_pre + tl.load(base + stream)[None, :]) + hc_eps
    q = 2.0 * tl.sigmoid(tl.load(scale + 1) * m_post + tl.load(base + HC + stream)[None, :])
    tl.store(pre + gate, p, mask=live[:, None])
    tl.store(post + gate, q, mask=live[:, None])

    cell = stream[:, None] * HC + stream[None, :]
    logits = _summed(dots, token[:, None, None] * ROWS + 2 * HC + cell[None, :, :], live[:, None, None], SPLITS,
                     stride) * inv[:, None, None]
    logits = tl.load(scale + 2) * logits + tl.load(base + 2 * HC + cell)[None, :, :]
    shifted = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    matrix = shifted / tl.sum(shifted, axis=2)[:, :, None] + hc_eps
    if COLUMN_ROW:  # ITERS times the columns and the rows
        for _ in range(ITERS):
            matrix = matrix / (tl.sum(matrix, axis=1)[:, None, :] + hc_eps)
            matrix = matrix / (tl.sum(matrix, axis=2)[:, :, None] + hc_eps)
    elif ITERS > 0:  # DeepInfer's: the columns, then ITERS - 1 times the rows and the columns
        matrix = matrix / (tl.sum(matrix, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):
            matrix = matrix / (tl.sum(matrix, axis=2)[:, :, None] + hc_eps)
            matrix = matrix / (tl.sum(matrix, axis=1)[:, None, :] + hc_eps)
    tl.store(comb + token[:, None, None] * (HC * HC) + cell[None, :, :], matrix, mask=live[:, None, None])


@triton.jit
def mhc_head_kernel(dots, squares, scale, base, weights, tokens, width, norm_eps, hc_eps, SPLITS: tl.constexpr,
                    HC: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens ``[BLOCK * pid, BLOCK * (pid + 1))``: the head's stream weights
    ``sigmoid(scale[0] * m + base) + hc_eps`` ``[tokens, HC]`` from the partials."""
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _finish_head(dots, squares, scale, base, weights, token, tokens, width, norm_eps, hc_eps, SPLITS, HC, ROWS)


@triton.jit
def _finish_head(dots, squares, scale, base, weights, token, tokens, width, norm_eps, hc_eps, SPLITS: tl.constexpr,
                 HC: tl.constexpr, ROWS: tl.constexpr):
    """The head's stream weights of the tokens ``token`` (a vector) from the partials."""
    live = token < tokens
    inv = _inverse_rms(squares, token, live, tokens, SPLITS, width, norm_eps)
    stream = tl.arange(0, HC)
    m = _summed(dots, token[:, None] * ROWS + stream[None, :], live[:, None], SPLITS, tokens * ROWS) * inv[:, None]
    w = tl.sigmoid(tl.load(scale) * m + tl.load(base + stream)[None, :]) + hc_eps
    tl.store(weights + token[:, None] * HC + stream[None, :], w, mask=live[:, None])


@triton.jit
def mhc_mixes_one_pass(x, fn, dots, squares, arrivals, scale, base, pre, post, comb, tokens, width, rows, x_stride,
                       norm_eps, hc_eps, ROWS: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_K: tl.constexpr, PARTS: tl.constexpr, UPCAST: tl.constexpr, SPLITS: tl.constexpr,
                       HC: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr, FINISH: tl.constexpr,
                       COLUMN_ROW: tl.constexpr = False):
    """:func:`mhc_mix_partials` and the finishing kernel in one launch: the program that writes
    the last slice of a token block (counted in ``arrivals[pid0]``, int32, zero before and after
    the launch) finishes that block's tokens, ``FINISH`` at a time: :func:`mhc_mixes_kernel`'s
    outputs, or with ``HEAD`` :func:`mhc_head_kernel`'s (``pre`` the weights; ``post``, ``comb``
    ``ITERS`` and ``COLUMN_ROW`` unused). The same arithmetic in the same order as the two launches."""
    mhc_mix_partials(x, fn, dots, squares, tokens, width, rows, x_stride, ROWS, BLOCK, SPLIT, BLOCK_K, PARTS, UPCAST)
    tl.debug_barrier()
    block = tl.program_id(0)
    if tl.atomic_add(arrivals + block, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        tl.atomic_xchg(arrivals + block, 0, sem="relaxed", scope="gpu")
        first = block * BLOCK
        for start in range(first, tl.minimum(first + BLOCK, tokens), FINISH):
            token = start + tl.arange(0, FINISH)
            if HEAD:
                _finish_head(dots, squares, scale, base, pre, token, tokens, width, norm_eps, hc_eps, SPLITS, HC,
                             ROWS)
            else:
                _finish_mixes(dots, squares, scale, base, pre, post, comb, token, tokens, width, norm_eps, hc_eps,
                              SPLITS, HC, ROWS, ITERS, COLUMN_ROW)


def main() -> None:
    """Check the mHC mixes and head kernels against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("mhc_mixes", "mhc_head")


if __name__ == "__main__":
    main()
