"""Manifold hyper-connections (mHC): the residual trunk as ``hc`` streams of width ``H``.

Each sublayer reads ``sum_m pre_m * residual_m`` and writes back
``residual'_n = post_n * y + sum_m comb[m, n] * residual_m``; ``pre``, ``post`` and the
doubly-stochastic ``comb`` are computed per token from the normalized, flattened residual."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.norm import rms_norm
from deepinfer.hal.spec import OpCase, OpSpec, register


def mhc_mixes(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
              norm_eps: float, hc_eps: float, sinkhorn_iters: int, sinkhorn_order: str = "deepinfer"):
    """Per-token mixing weights ``(pre [T, hc], post [T, hc], comb [T, hc, hc])``, float32.

    ``residual``: ``[T, hc, H]``; ``fn``: float32 ``[hc*(2+hc), hc*H]`` (RMSNorm weight folded
    in); ``scale``: ``[3]``; ``base``: ``[hc*(2+hc)]``. With ``m = (flat @ fn.T) *
    rsqrt(mean(flat^2) + norm_eps)`` over ``flat = residual.flatten(1)``, split as ``hc`` pre,
    ``hc`` post and ``hc*hc`` comb values (row-major: ``comb[m, n]``, from stream m to stream n):
    ``pre = sigmoid(scale[0]*m_pre + base_pre) + hc_eps``, ``post = 2*sigmoid(scale[1]*m_post +
    base_post)``, ``comb = sinkhorn(scale[2]*m_comb + base_comb)`` in ``sinkhorn_order``; see
    :func:`sinkhorn`."""
    tokens, hc, _ = _check_residual(residual)
    _check_shape("fn", fn, (hc * (2 + hc), residual.shape[1] * residual.shape[2]))
    _check_shape("scale", scale, (3,))
    _check_shape("base", base, (hc * (2 + hc),))
    if sinkhorn_iters < 0:
        raise ValueError(f"sinkhorn_iters must be >= 0, got {sinkhorn_iters}")
    mixes = normalized_mixes(residual, fn, norm_eps)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(scale[0] * mixes[:, :hc] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(scale[1] * mixes[:, hc:2 * hc] + base[hc:2 * hc])
    comb_logits = (scale[2] * mixes[:, 2 * hc:] + base[2 * hc:]).reshape(tokens, hc, hc)
    return pre, post, sinkhorn(comb_logits, hc_eps, sinkhorn_iters, sinkhorn_order)


SINKHORN_ORDERS = ("deepinfer", "column_row")


def sinkhorn(logits: torch.Tensor, eps: float, iters: int, order: str = "deepinfer") -> torch.Tensor:
    """``M = softmax(logits, -1) + eps``, then normalisation passes, each dividing every column
    (or row) by its sum plus ``eps``. ``logits``: ``[..., n, n]``; ``iters`` 0 leaves ``M``.

    - ``order="deepinfer"`` (DeepInfer's, the official checkpoints'): the columns, then
      ``iters - 1`` times the rows and the columns; the matrix ends column-normalised after
      ``2 * iters - 1`` passes.
    - ``order="column_row"``: ``iters`` times the columns and the rows; it ends row-normalised."""
    if order not in SINKHORN_ORDERS:
        raise ValueError(f"sinkhorn order must be one of {list(SINKHORN_ORDERS)}, got {order!r}")
    matrix = torch.softmax(logits.float(), dim=-1) + eps
    if order == "column_row":
        for _ in range(iters):
            matrix = _by_rows(_by_columns(matrix, eps), eps)
        return matrix
    if iters:
        matrix = _by_columns(matrix, eps)
    for _ in range(iters - 1):
        matrix = _by_columns(_by_rows(matrix, eps), eps)
    return matrix


def _by_columns(matrix: torch.Tensor, eps: float) -> torch.Tensor:
    return matrix / (matrix.sum(dim=-2, keepdim=True) + eps)


def _by_rows(matrix: torch.Tensor, eps: float) -> torch.Tensor:
    return matrix / (matrix.sum(dim=-1, keepdim=True) + eps)


def mhc_pre(residual: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sublayer input ``[T, H] = sum_m pre[:, m] * residual[:, m]``, float32 math, in ``residual.dtype``."""
    tokens, hc, _ = _check_residual(residual)
    _check_shape("pre", pre, (tokens, hc))
    return (pre.float()[:, :, None] * residual.float()).sum(dim=1).to(residual.dtype)


def mhc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New residual ``[T, hc, H]``: ``out[:, n] = post[:, n] * y + sum_m comb[:, m, n] * residual[:, m]``.

    ``y``: sublayer output ``[T, H]``; float32 math, returned in ``residual.dtype``."""
    tokens, hc, hidden = _check_residual(residual)
    _check_shape("y", y, (tokens, hidden))
    _check_shape("post", post, (tokens, hc))
    _check_shape("comb", comb, (tokens, hc, hc))
    written = post.float()[:, :, None] * y.float()[:, None, :]
    carried = torch.einsum("tmn,tmh->tnh", comb.float(), residual.float())
    return (written + carried).to(residual.dtype)


def mhc_post_pre(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 pre: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 norm_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mhc_post`, then :func:`mhc_pre` of its result with ``pre``: ``(new residual [T, hc,
    H], next sublayer input [T, H])``, both in ``residual.dtype``. With ``norm_weight`` ``[H]``
    the input comes RMS-normalised: ``rms_norm(input, norm_weight, norm_eps)`` of the rounded input.

    Under shifted hyper-connections the next sublayer reads the new trunk with this sublayer's
    ``pre`` mix, known before this one's output; a backend can then write the trunk and read it
    (and normalise it for the next sublayer) in one pass (the input is the weighted sum of the
    stored, rounded trunk)."""
    new = mhc_post(y, residual, post, comb)
    x = mhc_pre(new, pre)
    if norm_weight is not None:
        _check_shape("norm_weight", norm_weight, (residual.shape[2],))
        x = rms_norm(x, norm_weight, norm_eps)
    return new, x


def mhc_head(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Stream weights ``[T, hc]`` float32 of the final HC head (non-shifted models only).

    ``fn``: ``[hc, hc*H]``; ``scale``: ``[1]``; ``base``: ``[hc]``. Returns
    ``sigmoid(scale[0] * m + base) + hc_eps`` with ``m`` normalized as in :func:`mhc_mixes`."""
    _, hc, hidden = _check_residual(residual)
    _check_shape("fn", fn, (hc, hc * hidden))
    _check_shape("scale", scale, (1,))
    _check_shape("base", base, (hc,))
    mixes = normalized_mixes(residual, fn, norm_eps)
    return torch.sigmoid(scale.float()[0] * mixes + base.float()) + hc_eps


def normalized_mixes(residual: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``(flat @ fn.T) * rsqrt(mean(flat^2) + norm_eps)`` with ``flat = residual.flatten(1)``,
    float32 ``[T, rows of fn]``: the raw mixes before their scales, biases and Sinkhorn."""
    flat = residual.float().flatten(1)
    inv_rms = torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + norm_eps)
    return (flat @ fn.float().T) * inv_rms


def _check_residual(residual: torch.Tensor) -> tuple[int, int, int]:
    if residual.dim() != 3:
        raise ValueError(f"residual must be [T, hc, H], got shape {tuple(residual.shape)}")
    return tuple(residual.shape)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)}, got {list(tensor.shape)}")


def _residual(gen, tokens, hc, hidden, dtype, device):
    return torch.randn(tokens, hc, hidden, generator=gen).to(device, dtype)


def _weights(gen, rows, hc, hidden, device):
    fn = torch.randn(rows, hc * hidden, generator=gen) / (hc * hidden) ** 0.5
    return fn.to(device), (0.5 * torch.randn(rows, generator=gen)).to(device)


def _mixes_case(tokens: int, hc: int, hidden: int, iters: int, dtype=torch.float32, hc_eps: float = 1e-6,
                order: str = "deepinfer"):
    def make(gen: torch.Generator, device: torch.device):
        fn, base = _weights(gen, hc * (2 + hc), hc, hidden, device)
        return {"residual": _residual(gen, tokens, hc, hidden, dtype, device), "fn": fn,
                "scale": torch.tensor([0.7, 0.9, 1.3], device=device), "base": base,
                "norm_eps": 1e-6, "hc_eps": hc_eps, "sinkhorn_iters": iters, "sinkhorn_order": order}
    return make


def _head_case(tokens: int, hc: int, hidden: int, hc_eps: float = 1e-6, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        fn, base = _weights(gen, hc, hc, hidden, device)
        return {"residual": _residual(gen, tokens, hc, hidden, dtype, device), "fn": fn,
                "scale": torch.tensor([0.8], device=device), "base": base, "norm_eps": 1e-6, "hc_eps": hc_eps}
    return make


def _pre_case(tokens: int, hc: int, hidden: int, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        return {"residual": _residual(gen, tokens, hc, hidden, dtype, device),
                "pre": torch.rand(tokens, hc, generator=gen).to(device)}
    return make


def _post_case(tokens: int, hc: int, hidden: int, dtype=torch.float32, with_pre: bool = False,
               normed: bool = False):
    def make(gen: torch.Generator, device: torch.device):
        args = {"y": torch.randn(tokens, hidden, generator=gen).to(device, dtype),
                "residual": _residual(gen, tokens, hc, hidden, dtype, device),
                "post": (2 * torch.rand(tokens, hc, generator=gen)).to(device),
                "comb": sinkhorn(torch.randn(tokens, hc, hc, generator=gen), 1e-6, 20).to(device)}
        if with_pre:
            args["pre"] = torch.rand(tokens, hc, generator=gen).to(device)
        if normed:
            args["norm_weight"] = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
            args["norm_eps"] = 1e-6
        return args
    return make


register(OpSpec(
    name="mhc_mixes",
    summary="mHC pre/post weights and Sinkhorn-normalized stream mixing matrix per token",
    reference=mhc_mixes,
    cases=(
        OpCase("tiny_hc4", _mixes_case(5, 4, 16, 3)),
        OpCase("tiny_hc2_large_eps", _mixes_case(3, 2, 8, 2, hc_eps=0.01)),
        OpCase("tiny_bf16_residual", _mixes_case(4, 4, 16, 5, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_column_row_bf16", _mixes_case(6, 4, 16, 8, torch.bfloat16, order="column_row"),
               dtype=torch.bfloat16),
        OpCase("many_tokens_bf16", _mixes_case(150, 4, 64, 20, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_hidden", _mixes_case(8, 4, 4096, 20), size="real"),
        OpCase("v41_hidden_bf16", _mixes_case(8, 4, 4096, 20, torch.bfloat16), size="real", dtype=torch.bfloat16),
    ),
))

register(OpSpec(
    name="mhc_pre",
    summary="mHC sublayer input: pre-weighted sum of the residual streams",
    reference=mhc_pre,
    cases=(
        OpCase("tiny_hc4", _pre_case(5, 4, 16)),
        OpCase("tiny_hc2", _pre_case(3, 2, 8)),
        OpCase("tiny_bf16", _pre_case(4, 4, 16, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("wide_bf16", _pre_case(3, 4, 1100, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_hidden", _pre_case(8, 4, 4096), size="real"),
    ),
))

register(OpSpec(
    name="mhc_post",
    summary="mHC residual update: post-weighted sublayer output plus comb-mixed streams",
    reference=mhc_post,
    cases=(
        OpCase("tiny_hc4", _post_case(5, 4, 16)),
        OpCase("tiny_hc2", _post_case(3, 2, 8)),
        OpCase("tiny_bf16", _post_case(4, 4, 16, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("wide_bf16", _post_case(3, 4, 1100, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_hidden", _post_case(8, 4, 4096), size="real"),
    ),
))

register(OpSpec(
    name="mhc_post_pre",
    summary="mHC residual update, then the next sublayer's input read from it with a given pre mix",
    reference=mhc_post_pre,
    cases=(
        OpCase("tiny_hc4", _post_case(5, 4, 16, with_pre=True)),
        OpCase("tiny_hc2", _post_case(3, 2, 8, with_pre=True)),
        OpCase("tiny_bf16", _post_case(4, 4, 16, torch.bfloat16, with_pre=True), dtype=torch.bfloat16),
        OpCase("wide_bf16", _post_case(3, 4, 1100, torch.bfloat16, with_pre=True), dtype=torch.bfloat16),
        OpCase("v41_hidden", _post_case(8, 4, 4096, with_pre=True), size="real"),
        OpCase("v41_hidden_bf16", _post_case(8, 4, 4096, torch.bfloat16, with_pre=True), size="real",
               dtype=torch.bfloat16),
        OpCase("tiny_normed", _post_case(5, 4, 16, with_pre=True, normed=True)),
        OpCase("wide_normed_bf16", _post_case(3, 4, 1100, torch.bfloat16, with_pre=True, normed=True),
               dtype=torch.bfloat16),
        OpCase("v41_hidden_normed_bf16", _post_case(8, 4, 4096, torch.bfloat16, with_pre=True, normed=True),
               size="real", dtype=torch.bfloat16),
    ),
))

register(OpSpec(
    name="mhc_head",
    summary="mHC head of non-shifted models: sigmoid stream weights",
    reference=mhc_head,
    cases=(
        OpCase("tiny_hc4", _head_case(5, 4, 16)),
        OpCase("tiny_hc2_large_eps", _head_case(3, 2, 8, hc_eps=0.01)),
        OpCase("tiny_bf16_residual", _head_case(5, 4, 16, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_hidden", _head_case(8, 4, 4096), size="real"),
    ),
))
