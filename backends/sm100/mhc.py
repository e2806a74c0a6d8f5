"""sm100 mHC ops in Triton (:mod:`.fused.mhc_mixes`, :mod:`.fused.mhc_streams`).

``mhc_mixes`` and ``mhc_head``: the flattened residual's dot products with ``fn`` and its sum of
squares in fixed slices of the width, then one kernel that adds the slices up, normalises and
computes the gates (and the whole Sinkhorn normalisation); for a decode step's few tokens both in
one launch, the program that writes a token block's last slice finishing it (outside the
batch-invariant mode). ``mhc_pre`` and ``mhc_post``: one pass over the streams each;
``mhc_post_pre`` both in one (and the next input's RMSNorm). Every token's arithmetic is fixed by the widths alone."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.mhc import SINKHORN_ORDERS
from deepinfer_backends.sm100.launch import TRITON_INTERPRETED, float32_param, on_device, param_copy, require

MAX_STREAMS = 16


def mhc_mixes(residual, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters, sinkhorn_order: str = "deepinfer",
              batch_invariant: bool = False):
    """HAL ``mhc_mixes`` for a CUDA ``residual [T, hc, H]`` (bf16 or float32), ``hc`` a power of
    two up to :data:`MAX_STREAMS`; float32 ``(pre [T, hc], post [T, hc], comb [T, hc, hc])``.
    ``batch_invariant`` keeps the two launches (and their finishing tiles) at every token count."""
    tokens, hc, hidden = _streams("mhc_mixes", residual)
    _shapes("mhc_mixes", (("fn", fn, (hc * (2 + hc), hc * hidden)), ("scale", scale, (3,)),
                          ("base", base, (hc * (2 + hc),))))
    if sinkhorn_iters < 0:
        raise ValueError(f"mhc_mixes: sinkhorn_iters must be >= 0, got {sinkhorn_iters}")
    if sinkhorn_order not in SINKHORN_ORDERS:
        raise ValueError(f"mhc_mixes: sinkhorn_order must be one of {list(SINKHORN_ORDERS)}, got {sinkhorn_order!r}")
    column_row = sinkhorn_order == "column_row"
    from deepinfer_backends.sm100.fused.mhc_mixes import FINISH_TOKENS, FINISH_WARPS, mhc_mixes_kernel

    pre = torch.empty(tokens, hc, dtype=torch.float32, device=residual.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=residual.device)
    if tokens and (batch_invariant or not _one_pass(residual, fn, scale, base, norm_eps, hc_eps, pre, post, comb,
                                                    sinkhorn_iters, column_row)):
        dots, squares, splits, rows = _partials(residual, fn)
        mhc_mixes_kernel[(-(-tokens // FINISH_TOKENS),)](
            dots, squares, float32_param(scale), float32_param(base), pre, post, comb, tokens,
            hc * hidden, float(norm_eps), float(hc_eps), SPLITS=splits, HC=hc, ROWS=rows, ITERS=int(sinkhorn_iters),
            BLOCK=FINISH_TOKENS, COLUMN_ROW=column_row, num_warps=FINISH_WARPS)
    return pre, post, comb


def mhc_head(residual, fn, scale, base, norm_eps, hc_eps, batch_invariant: bool = False):
    """HAL ``mhc_head`` for a CUDA ``residual [T, hc, H]``; float32 ``[T, hc]`` (``batch_invariant``
    as for :func:`mhc_mixes`)."""
    tokens, hc, hidden = _streams("mhc_head", residual)
    _shapes("mhc_head", (("fn", fn, (hc, hc * hidden)), ("scale", scale, (1,)), ("base", base, (hc,))))
    from deepinfer_backends.sm100.fused.mhc_mixes import FINISH_TOKENS, FINISH_WARPS, mhc_head_kernel

    weights = torch.empty(tokens, hc, dtype=torch.float32, device=residual.device)
    if tokens and (batch_invariant or not _one_pass(residual, fn, scale, base, norm_eps, hc_eps, weights)):
        dots, squares, splits, rows = _partials(residual, fn)
        mhc_head_kernel[(-(-tokens // FINISH_TOKENS),)](
            dots, squares, float32_param(scale), float32_param(base), weights, tokens, hc * hidden,
            float(norm_eps), float(hc_eps), SPLITS=splits, HC=hc, ROWS=rows, BLOCK=FINISH_TOKENS,
            num_warps=FINISH_WARPS)
    return weights


def mhc_pre(residual, pre):
    """HAL ``mhc_pre``: ``[T, H]`` in ``residual.dtype``."""
    tokens, hc, hidden = _streams("mhc_pre", residual)
    _shapes("mhc_pre", (("pre", pre, (tokens, hc)),))
    from deepinfer_backends.sm100.fused.mhc_streams import BLOCK_HIDDEN, mhc_pre_kernel

    out = torch.empty(tokens, hidden, dtype=residual.dtype, device=residual.device)
    if tokens:
        mhc_pre_kernel[(tokens, -(-hidden // BLOCK_HIDDEN))](
            residual.contiguous(), pre.float().contiguous(), out, hidden, HC=hc, BLOCK=BLOCK_HIDDEN, num_warps=4)
    return out


def mhc_post(y, residual, post, comb):
    """HAL ``mhc_post``: the new residual ``[T, hc, H]`` in ``residual.dtype``."""
    return _post("mhc_post", y, residual, post, comb)[0]


def mhc_post_pre(y, residual, post, comb, pre, norm_weight=None, norm_eps: float = 1e-6):
    """HAL ``mhc_post_pre``: the new residual ``[T, hc, H]`` and the next sublayer's input ``[T, H]``
    (read from it with ``pre``, RMS-normalised with ``norm_weight`` when given), both in
    ``residual.dtype``, in one pass."""
    return _post("mhc_post_pre", y, residual, post, comb, pre, norm_weight, norm_eps)


def _post(op, y, residual, post, comb, pre=None, norm_weight=None, norm_eps: float = 1e-6):
    """``(new residual, next input or None)`` by :func:`~.fused.mhc_streams.mhc_post_kernel`; the
    next input is read from the new residual with ``pre`` when it is given, and normalised with
    ``norm_weight`` (a program per token holding the whole row) when that is given."""
    import triton

    tokens, hc, hidden = _streams(op, residual)
    _shapes(op, (("y", y, (tokens, hidden)), ("post", post, (tokens, hc)), ("comb", comb, (tokens, hc, hc)))
            + ((("pre", pre, (tokens, hc)),) if pre is not None else ())
            + ((("norm_weight", norm_weight, (hidden,)),) if norm_weight is not None else ()))
    from deepinfer_backends.sm100.fused.mhc_streams import BLOCK_HIDDEN, mhc_post_kernel

    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    x = None if pre is None else torch.empty(tokens, hidden, dtype=residual.dtype, device=residual.device)
    if tokens:
        normed = norm_weight is not None
        block = triton.next_power_of_2(hidden) if normed else BLOCK_HIDDEN
        post, comb = post.float().contiguous(), comb.float().contiguous()
        mhc_post_kernel[(tokens, -(-hidden // block))](
            y.contiguous(), residual.contiguous(), post, comb, post if pre is None else pre.float().contiguous(), out,
            out if x is None else x, float32_param(norm_weight) if normed else post, hidden, float(norm_eps), HC=hc,
            BLOCK=block, READ_NEXT=pre is not None, NORM=normed, num_warps=max(4, min(16, block // 512)))
    return out, x


def _partials(residual, fn, finish: dict | None = None):
    """The float32 partial dot products ``[splits, T, rows]`` (rows of ``fn`` padded to a power
    of two, at least 16) and sums of squares ``[splits, T]`` of the flattened residual; with
    ``finish`` (:func:`_one_pass`'s arguments) the one-pass kernel, which also finishes."""
    import triton
    from deepinfer_backends.sm100.fused.mhc_mixes import (BLOCK_K, BLOCK_TOKENS, SPLIT, bf16_parts, mhc_mix_partials,
                                                          mhc_mixes_one_pass)

    flat = residual.reshape(residual.shape[0], -1)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    tokens, width = flat.shape
    rows = max(16, triton.next_power_of_2(fn.shape[0]))
    splits = -(-width // SPLIT)
    parts = 3 if flat.dtype == torch.bfloat16 else 1
    weights = param_copy(fn, "mhc_bf16_parts", bf16_parts) if parts == 3 else float32_param(fn)
    dots = torch.empty(splits, tokens, rows, dtype=torch.float32, device=residual.device)
    squares = torch.empty(splits, tokens, dtype=torch.float32, device=residual.device)
    grid = (-(-tokens // BLOCK_TOKENS), splits)
    tiles = dict(ROWS=rows, BLOCK=BLOCK_TOKENS, SPLIT=SPLIT, BLOCK_K=BLOCK_K, PARTS=parts, UPCAST=TRITON_INTERPRETED,
                 num_warps=4)
    if finish is None:
        mhc_mix_partials[grid](flat, weights, dots, squares, tokens, width, fn.shape[0], flat.stride(0), **tiles)
    else:
        mhc_mixes_one_pass[grid](flat, weights, dots, squares, finish["arrivals"], finish["scale"], finish["base"],
                                 finish["pre"], finish["post"], finish["comb"], tokens, width, fn.shape[0],
                                 flat.stride(0), finish["norm_eps"], finish["hc_eps"], SPLITS=splits,
                                 HC=residual.shape[1], ITERS=finish["iters"], HEAD=finish["head"],
                                 FINISH=ONE_PASS_FINISH, COLUMN_ROW=finish.get("column_row", False), **tiles)
    return dots, squares, splits, rows


ONE_PASS_TOKENS = 64
"""Token counts up to which ``mhc_mixes`` and ``mhc_head`` run in one launch (a decode step's);
above it the finishing kernel's own tiles keep its latency-bound Sinkhorn loops spread wide."""
ONE_PASS_FINISH = 16
"""Tokens the one-pass kernel's finishing program takes at a time (four warps)."""
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _one_pass(residual, fn, scale, base, norm_eps, hc_eps, pre, post=None, comb=None, iters=None,
              column_row: bool = False) -> bool:
    """Run the mixes (``comb`` given) or the head in one launch when there are few tokens; False
    when the caller must run the two launches instead (many tokens, or no arrival counters yet
    while a CUDA graph is being captured: they are made outside a capture, zeroed once)."""
    from deepinfer_backends.sm100.fused.mhc_mixes import BLOCK_TOKENS

    tokens, device = residual.shape[0], residual.device
    if tokens > ONE_PASS_TOKENS:
        return False
    blocks = -(-tokens // BLOCK_TOKENS)
    arrivals = _ARRIVALS.get(device)
    if arrivals is None or arrivals.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        arrivals = _ARRIVALS[device] = torch.zeros(max(blocks, 1), dtype=torch.int32, device=device)
    head = comb is None
    _partials(residual, fn, dict(arrivals=arrivals, scale=float32_param(scale), base=float32_param(base), pre=pre,
                                 post=pre if head else post, comb=pre if head else comb, norm_eps=float(norm_eps),
                                 hc_eps=float(hc_eps), iters=0 if head else int(iters), head=head,
                                 column_row=column_row))
    return True


def _streams(op: str, residual) -> tuple[int, int, int]:
    require(on_device(residual) and residual.dim() == 3, op,
            "residual must be a [T, hc, H] CUDA tensor")
    require(residual.dtype in (torch.bfloat16, torch.float32), op,
            f"residual must be bf16 or float32, got {residual.dtype}")
    tokens, hc, hidden = residual.shape
    require(0 < hc <= MAX_STREAMS and hc & (hc - 1) == 0, op,
            f"the stream count hc={hc} must be a power of two up to {MAX_STREAMS}")
    return tokens, hc, hidden


def _shapes(op: str, named) -> None:
    for name, tensor, shape in named:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(tensor.shape)}")
