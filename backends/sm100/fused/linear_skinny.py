"""The ``linear`` of a few rows in one Triton kernel, for one weight or for up to
:data:`MAX_WEIGHTS` that share their input: each program takes ``BLOCK_N`` output columns of one
weight and streams that slice of it through shared memory in ``BLOCK_K`` steps, float32
accumulation, a bf16 store (float32 for FP8 weights). The weights are bf16, or all FP8 (e4m3
with UE8M0 scales per 32 along K, decoded exactly to bf16 in registers ahead of the dot). Each
weight's product is stored as its own contiguous ``[rows, N_i]`` block of one buffer, so the
callers read every product as a plain tensor. A product may leave with RoPE applied to its heads
(the HAL ``stacked_linear``'s ``rope_heads``): the epilogue rounds the tile to the products'
dtype, turns the interleaved pairs of each head's trailing dims by the row's angles, and stores
the turned values.

With a handful of rows a linear reads its weight once and is bound by memory: narrow column
blocks keep the SMs streaming, and one launch serves several weights that share their input.
The tiles depend only on the shapes, never on the row count up to :data:`BLOCK_T`."""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from deepinfer.hal.formats import Quantized
from deepinfer_backends.sm100.fused.mxfp4_cast import cast_blocks
from deepinfer_backends.sm100.fused.swiglu import clamped_swiglu

BLOCK_T = 16
"""Rows a program holds; a call takes this kernel up to this many rows."""
MAX_WEIGHTS = 5
"""Weights one launch reads (more are served by several launches)."""
TILES = {32: {"block_n": 32, "block_k": 256, "warps": 4, "stages": 4},
         16: {"block_n": 16, "block_k": 512, "warps": 4, "stages": 3}}
"""Column block, depth step, warps and pipeline depth, by the column block: 32 where every width
allows it, else 16 (``experiments/linear_stacked.py``; ``experiments/results/linear_stacked_h200.csv``)."""
NORM_MAX_K = 2048
"""Longest rows the kernel normalises itself (every program reads its rows once more for their
squares); longer ones (the model's hidden width) come normalised by an ``rms_norm`` launch."""


def tiles_for(widths: list[int]) -> dict[str, int] | None:
    """The tiles of :data:`TILES` for weights of ``widths`` (None when some width is not a
    multiple of 16)."""
    return next((TILES[n] for n in TILES if all(width % n == 0 for width in widths)), None)


@triton.jit
def e4m3_to_bf16(codes, scale_rows, step, k, rows_read, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` e4m3 ``codes`` (uint8; values ``step ..`` of K) times their UE8M0
    scales (one byte per 32 values, at ``scale_rows + K index // 32``; read where ``rows_read``
    ``[BLOCK_N]``), as bf16: exact wherever the values are finite bf16 normals (every code under
    scale bytes 10 to 246); byte 0 reads as zero (``2 ** -127`` is a float32 subnormal; no weight
    encoder writes it)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    group = step // 32 + tl.arange(0, GROUPS)
    byte = tl.load(scale_rows + group[None, :], mask=rows_read[:, None] & (group * 32 < k)[None, :],
                   other=0).to(tl.int32)
    factor = tl.reshape(tl.broadcast_to((byte << 23).to(tl.float32, bitcast=True)[:, :, None],
                                        (BLOCK_N, GROUPS, 32)), (BLOCK_N, BLOCK_K))
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * factor).to(tl.bfloat16)


@triton.jit
def linear_skinny_kernel(x, w0, w1, w2, w3, w4, y, rows, k, x_stride, end0, end1, end2, end3, end4, positions,
                         cos_sin, table_stride, head0, head1, head2, head3, head4, w_up, gated_from, limit,
                         norm_weight, norm_eps, mxfp4_mask, s0, s1, s2, s3, s4, s_up, WEIGHTS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr, ROPE: tl.constexpr = 0, GATED: tl.constexpr = False,
                         CLAMP: tl.constexpr = False, NORM: tl.constexpr = False, MXFP4: tl.constexpr = False,
                         FP8: tl.constexpr = False):
    """Columns ``[BLOCK_N * pid0, BLOCK_N * (pid0 + 1))`` and rows ``[BLOCK_T * pid1, ..)`` of
    ``x [rows, k] @ cat(w0 .. w{WEIGHTS - 1}).T`` (rows of ``x`` ``x_stride`` elements apart);
    ``end0 ..``: the weights' cumulative widths (each width a multiple of ``BLOCK_N``). The product
    with weight ``i``, columns ``[start, end)``, is stored as a contiguous ``[rows, end - start]``
    block at element ``rows * start`` of ``y``. With ``ROPE`` (the rotated dims, 0 for none) and
    ``head_i`` > 0, the trailing ``ROPE`` columns of each ``head_i``-wide head of product ``i`` are
    turned in interleaved pairs by row ``positions[r]`` of ``cos_sin`` (cos then sin,
    ``table_stride`` apart).
    With ``GATED`` the programs from column ``gated_from`` on (the last weight, a gate) also read
    the same rows of ``w_up`` and store the SwiGLU of the two products, each rounded to ``y``'s
    dtype first (``min(gate, limit)`` and ``clamp(up, -limit, limit)`` with ``CLAMP``).
    With ``NORM`` the weights read the rows of ``x`` RMS-normalised as the HAL ``rms_norm`` does
    (float32, times ``norm_weight``) and rounded to the weights' dtype: a first pass over ``k``
    sums each row's squares (meant for short rows, a few KB), the loop normalises each step.
    With ``MXFP4`` (``BLOCK_N`` a multiple of 32) the products whose bit is set in ``mxfp4_mask``
    leave rounded to ``y``'s dtype and cast through MXFP4 and back, a scale per 32 columns.
    With ``FP8`` every weight (and ``w_up``) is e4m3 codes (uint8) with UE8M0 scales ``s0 ..``
    (``s_up``), ``[N_i, k / 32]``, decoded to bf16 in registers (:func:`e4m3_to_bf16`); ``k`` a
    multiple of 32."""
    col0 = tl.program_id(0) * BLOCK_N
    start = end0 * 0
    end = end0
    w = w0
    ws = s0
    head = head0
    index = 0
    if WEIGHTS > 1:
        if col0 >= end0:
            start, end, w, ws, head, index = end0, end1, w1, s1, head1, 1
    if WEIGHTS > 2:
        if col0 >= end1:
            start, end, w, ws, head, index = end1, end2, w2, s2, head2, 2
    if WEIGHTS > 3:
        if col0 >= end2:
            start, end, w, ws, head, index = end2, end3, w3, s3, head3, 3
    if WEIGHTS > 4:
        if col0 >= end3:
            start, end, w, ws, head, index = end3, end4, w4, s4, head4, 4
    row = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = row < rows
    local = col0 - start + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    x_rows = x + row[:, None].to(tl.int64) * x_stride
    w_rows = w + local[:, None].to(tl.int64) * k
    scale_rows = ws + local[:, None].to(tl.int64) * (k // 32)
    up_scale_rows = s_up + local[:, None].to(tl.int64) * (k // 32)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    gated = col0 + tl.arange(0, BLOCK_N) >= gated_from  # one value for the whole column block
    if NORM:
        squares = tl.zeros((BLOCK_T,), tl.float32)
        for step in tl.range(0, k, BLOCK_K):
            kk = step + depth
            a = tl.load(x_rows + kk[None, :], mask=live[:, None] & (kk < k)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(a * a, axis=1)
        inverse_rms = 1.0 / tl.sqrt_rn(squares / k + norm_eps)
    for step in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
        kk = step + depth
        within = kk < k
        a = tl.load(x_rows + kk[None, :], mask=live[:, None] & within[None, :], other=0.0)
        if NORM:
            gain = tl.load(norm_weight + kk, mask=within, other=0.0)
            a = (a.to(tl.float32) * inverse_rms[:, None] * gain[None, :]).to(tl.bfloat16 if FP8
                                                                            else w0.dtype.element_ty)
        b = tl.load(w_rows + kk[None, :], mask=within[None, :], other=0)
        if FP8:
            b = e4m3_to_bf16(b, scale_rows, step, k, local >= 0, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, tl.trans(b), acc)
        if GATED:  # the other programs' loads are masked off: no traffic, a dot of zeros
            c = tl.load(w_up + local[:, None].to(tl.int64) * k + kk[None, :],
                        mask=gated[:, None] & within[None, :], other=0)
            if FP8:
                c = e4m3_to_bf16(c, up_scale_rows, step, k, gated, BLOCK_N, BLOCK_K)
            up = tl.dot(a, tl.trans(c), up)
    out = y + start.to(tl.int64) * rows + row[:, None].to(tl.int64) * (end - start) + local[None, :]
    if ROPE:
        product = acc.to(y.dtype.element_ty).to(tl.float32)
        even, odd = tl.split(tl.reshape(product, (BLOCK_T, BLOCK_N // 2, 2)))
        within = (col0 - start + 2 * tl.arange(0, BLOCK_N // 2)) % tl.maximum(head, 1)
        turning = live[:, None] & ((within >= head - ROPE) & (within * 0 + head > 0))[None, :]
        position = tl.load(positions + row, mask=live, other=0)
        angle = cos_sin + position[:, None].to(tl.int64) * table_stride + ((within - (head - ROPE)) // 2)[None, :]
        cos = tl.load(angle, mask=turning, other=1.0)
        sin = tl.load(angle + ROPE // 2, mask=turning, other=0.0)
        acc = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), (BLOCK_T, BLOCK_N))
    if GATED:
        activation = clamped_swiglu(acc.to(y.dtype.element_ty).to(tl.float32),
                                    up.to(y.dtype.element_ty).to(tl.float32), limit, CLAMP)
        acc = tl.where(gated[None, :], activation, acc)
    if MXFP4:
        if (mxfp4_mask >> index) & 1:
            blocks = tl.reshape(acc.to(y.dtype.element_ty).to(tl.float32), (BLOCK_T, BLOCK_N // 32, 32))
            acc = tl.reshape(cast_blocks(blocks), (BLOCK_T, BLOCK_N))
    tl.store(out, acc.to(y.dtype.element_ty), mask=live[:, None])


def linear_skinny(x: torch.Tensor, weights: list[torch.Tensor], tiles: dict[str, int] | None = None,
                  rope: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None,
                  gated: bool = False, limit: float | None = None, out_dtype: torch.dtype | None = None,
                  norm: tuple[torch.Tensor, float] | None = None, mxfp4: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` for bf16 ``x [rows, K]`` (unit stride along ``K``; with
    ``norm`` bf16 or float32) and
    contiguous bf16 ``weights [N_i, K]`` (each ``N_i`` a multiple of ``tiles["block_n"]``; default
    :func:`tiles_for` the widths): contiguous ``[rows, N_i]`` views of one buffer,
    :data:`MAX_WEIGHTS` weights a launch. ``rope``: ``(positions int64 [rows], cos_sin float32
    [P, R], head width per weight)`` turns each head's trailing ``R`` columns (the HAL
    ``stacked_linear``'s ``rope_heads``; widths 0, or multiples of the column block and at least ``R``).
    ``gated``: the last two weights are a gate and an up projection of one width, whose SwiGLU
    (``limit``: its clamp, None for none) takes their place among the products (the HAL
    ``stacked_linear``'s ``swiglu``; at most :data:`MAX_WEIGHTS` weights besides the up one).
    ``out_dtype``: the products' dtype (default the weights'; float32 stores the accumulator unrounded).
    ``norm``: ``(float32 weight [K], eps)``, the products of ``x`` RMS-normalised and rounded to bf16
    (the HAL ``stacked_linear``'s ``norm_weight``), computed in the kernel (:data:`NORM_MAX_K`).
    ``mxfp4``: the products (indices after the SwiGLU) cast through MXFP4 in the epilogue (the HAL
    ``stacked_linear``'s ``mxfp4_products``; 32-column tiles).
    ``weights`` may instead all be :class:`~deepinfer.hal.formats.Quantized` ``"fp8"`` (e4m3
    ``[N_i, K]``, UE8M0 per 32, contiguous), decoded to bf16 in the kernel; the products are then
    float32 unless ``out_dtype`` says otherwise (``linear``'s dtype for quantized operands)."""
    rows, k = x.shape
    fp8 = isinstance(weights[0], Quantized)
    scales = [w.scale for w in weights] if fp8 else [x] * len(weights)  # x: a pointer the kernel leaves unread
    weights = [w.data.view(torch.uint8) for w in weights] if fp8 else weights
    w_up, s_up = (weights[-1], scales[-1]) if gated else (x, x)
    weights, scales = (weights[:-1], scales[:-1]) if gated else (weights, scales)
    if gated and len(weights) > MAX_WEIGHTS:
        raise ValueError(f"a gated call takes at most {MAX_WEIGHTS} weights besides the up projection")
    widths = [w.shape[0] for w in weights]
    tiles = tiles or tiles_for(widths)
    if mxfp4 and tiles["block_n"] % 32:
        raise ValueError(f"the MXFP4 cast takes 32-column tiles, got {tiles['block_n']}")
    y = torch.empty(rows * sum(widths), dtype=out_dtype or (torch.float32 if fp8 else weights[0].dtype),
                    device=x.device)
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    positions, table, heads = rope if rope is not None else (y, y, [0] * len(weights))
    rotated = table.shape[1] if rope is not None else 0
    for first in range(0, len(weights) if rows else 0, MAX_WEIGHTS):
        chunk = weights[first:first + MAX_WEIGHTS]
        chunk_scales = scales[first:first + MAX_WEIGHTS]
        ends = list(itertools.accumulate(w.shape[0] for w in chunk))
        base = rows * sum(widths[:first])
        pad = MAX_WEIGHTS - len(chunk)
        linear_skinny_kernel[(ends[-1] // tiles["block_n"], -(-rows // BLOCK_T))](
            x, *chunk, *[chunk[0]] * pad, y[base:], rows, k, x.stride(0), *ends, *[ends[-1]] * pad, positions, table,
            table.stride(0), *heads[first:first + MAX_WEIGHTS], *[0] * pad, w_up,
            ends[-2] if gated and len(chunk) > 1 else (0 if gated else ends[-1]), float(limit or 0.0), norm_weight,
            float(eps), sum(1 << (i - first) for i in mxfp4 if first <= i < first + len(chunk)),
            *chunk_scales, *[chunk_scales[0]] * pad, s_up, WEIGHTS=len(chunk),
            BLOCK_T=BLOCK_T, BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"], NUM_STAGES=tiles["stages"],
            ROPE=rotated, GATED=gated, CLAMP=gated and limit is not None, NORM=norm is not None,
            MXFP4=any(first <= i < first + len(chunk) for i in mxfp4), FP8=fp8, num_warps=tiles["warps"])
    outs, offset = [], 0
    for width in widths:
        outs.append(y[offset:offset + rows * width].view(rows, width))
        offset += rows * width
    return outs


def main() -> None:
    """Check the kernel against the float64 products on this GPU (one weight and several, bf16 and
    FP8 weights), then the HAL ``stacked_linear`` (its RoPE and SwiGLU epilogues among the cases)
    against its OpSpec reference and tolerance (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    gen = torch.Generator().manual_seed(0)
    for widths, k, rows in (((1280, 512, 64, 512, 512), 4096, 1), ((4096,), 2048, 3), ((32768, 8192), 1280, 16),
                            ((16, 48, 32, 16, 64, 16, 32), 96, 5)):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16) for n in widths]
        got = linear_skinny(x.cuda(), [w.cuda() for w in ws])
        for g, w in zip(got, ws):
            want = x.double() @ w.double().T
            error = (g.cpu().double() - want).abs().max().item()
            assert g.is_contiguous() and error <= 2 ** -7 * want.abs().max().item(), f"{widths}, {rows} rows: {error}"
        print(f"linear_skinny: widths {widths}, K={k}, {rows} rows: ok")
    from deepinfer.hal.formats import quantize

    for widths, k, rows in (((1280, 512), 4096, 1), ((4096,), 2048, 3), ((512, 64, 32), 1280, 16)):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        ws = [quantize(torch.randn(n, k, generator=gen) / k ** 0.5, "fp8", 32) for n in widths]
        got = linear_skinny(x.cuda(), [Quantized(w.data.cuda(), w.scale.cuda(), w.fmt, w.block) for w in ws])
        for g, w in zip(got, ws):
            want = x.double() @ w.dequantize().double().T
            error = (g.cpu().double() - want).abs().max().item()
            assert g.dtype == torch.float32 and error <= 1e-5 * want.abs().max().item(), f"fp8 {widths}: {error}"
        print(f"linear_skinny: fp8 weights, widths {widths}, K={k}, {rows} rows: ok")
    from deepinfer_backends.sm100.selfcheck import run

    run("stacked_linear")


if __name__ == "__main__":
    main()
