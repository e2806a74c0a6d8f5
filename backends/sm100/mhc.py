"""sm100 mHC ops in Triton (:mod:`.fused.mhc_mixes`, :mod:`.fused.mhc_streams`).

``mhc_mixes`` and ``mhc_head``: the flattened residual's dot products with ``fn`` and its sum of
squares in fixed slices of the width, then one kernel that adds the slices up, normalises and
computes the gates (and the whole Sinkhorn normalisation). ``mhc_pre`` and ``mhc_post``: one pass
over the streams each; ``mhc_post_pre`` both in one. Every token's arithmetic is fixed by the widths alone (batch-invariant)."""
from __future__ import annotations

import torch

from deepinfer_backends.sm100.launch import TRITON_INTERPRETED, float32_param, on_device, param_copy, require

MAX_STREAMS = 16


def mhc_mixes(residual, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters):
    """HAL ``mhc_mixes`` for a CUDA ``residual [T, hc, H]`` (bf16 or float32), ``hc`` a power of
    two up to :data:`MAX_STREAMS`; float32 ``(pre [T, hc], post [T, hc], comb [T, hc, hc])``."""
    tokens, hc, hidden = _streams("mhc_mixes", residual)
    _shapes("mhc_mixes", (("fn", fn, (hc * (2 + hc), hc * hidden)), ("scale", scale, (3,)),
                          ("base", base, (hc * (2 + hc),))))
    if sinkhorn_iters < 0:
        raise ValueError(f"mhc_mixes: sinkhorn_iters must be >= 0, got {sinkhorn_iters}")
    from deepinfer_backends.sm100.fused.mhc_mixes import FINISH_TOKENS, FINISH_WARPS, mhc_mixes_kernel

    pre = torch.empty(tokens, hc, dtype=torch.float32, device=residual.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=residual.device)
    if tokens:
        dots, squares, splits, rows = _partials(residual, fn)
        mhc_mixes_kernel[(-(-tokens // FINISH_TOKENS),)](
            dots, squares, float32_param(scale), float32_param(base), pre, post, comb, tokens,
            hc * hidden, float(norm_eps), float(hc_eps), SPLITS=splits, HC=hc, ROWS=rows, ITERS=int(sinkhorn_iters),
            BLOCK=FINISH_TOKENS, num_warps=FINISH_WARPS)
    return pre, post, comb


def mhc_head(residual, fn, scale, base, norm_eps, hc_eps):
    """HAL ``mhc_head`` for a CUDA ``residual [T, hc, H]``; float32 ``[T, hc]``."""
    tokens, hc, hidden = _streams("mhc_head", residual)
    _shapes("mhc_head", (("fn", fn, (hc, hc * hidden)), ("scale", scale, (1,)), ("base", base, (hc,))))
    from deepinfer_backends.sm100.fused.mhc_mixes import FINISH_TOKENS, FINISH_WARPS, mhc_head_kernel

    weights = torch.empty(tokens, hc, dtype=torch.float32, device=residual.device)
    if tokens:
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


def mhc_post_pre(y, residual, post, comb, pre):
    """HAL ``mhc_post_pre``: the new residual ``[T, hc, H]`` and the next sublayer's input ``[T, H]``
    (read from it with ``pre``), both in ``residual.dtype``, in one pass."""
    return _post("mhc_post_pre", y, residual, post, comb, pre)


def _post(op, y, residual, post, comb, pre=None):
    """``(new residual, next input or None)`` by :func:`~.fused.mhc_streams.mhc_post_kernel`; the
    next input is read from the new residual with ``pre`` when it is given."""
    tokens, hc, hidden = _streams(op, residual)
    _shapes(op, (("y", y, (tokens, hidden)), ("post", post, (tokens, hc)), ("comb", comb, (tokens, hc, hc)))
            + ((("pre", pre, (tokens, hc)),) if pre is not None else ()))
    from deepinfer_backends.sm100.fused.mhc_streams import BLOCK_HIDDEN, mhc_post_kernel

    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    x = None if pre is None else torch.empty(tokens, hidden, dtype=residual.dtype, device=residual.device)
    if tokens:
        post, comb = post.float().contiguous(), comb.float().contiguous()
        mhc_post_kernel[(tokens, -(-hidden // BLOCK_HIDDEN))](
            y.contiguous(), residual.contiguous(), post, comb, post if pre is None else pre.float().contiguous(), out,
            out if x is None else x, hidden, HC=hc, BLOCK=BLOCK_HIDDEN, READ_NEXT=pre is not None, num_warps=4)
    return out, x


def _partials(residual, fn):
    """The float32 partial dot products ``[splits, T, rows]`` (rows of ``fn`` padded to a power
    of two, at least 16) and sums of squares ``[splits, T]`` of the flattened residual."""
    import triton
    from deepinfer_backends.sm100.fused.mhc_mixes import BLOCK_K, BLOCK_TOKENS, SPLIT, bf16_parts, mhc_mix_partials

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
    mhc_mix_partials[(-(-tokens // BLOCK_TOKENS), splits)](
        flat, weights, dots, squares, tokens, width, fn.shape[0], flat.stride(0), ROWS=rows, BLOCK=BLOCK_TOKENS,
        SPLIT=SPLIT, BLOCK_K=BLOCK_K, PARTS=parts, UPCAST=TRITON_INTERPRETED, num_warps=4)
    return dots, squares, splits, rows


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
