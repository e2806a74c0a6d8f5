"""Parameter-holding modules that compute only through HAL ops."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.formats import Quantized, quantize
from deepinfer.hal.registry import OpTable


QUANTIZED_DATA = {"fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}
"""What a held-quantized weight's data is stored as: e4m3, or e2m1 packed two per byte."""
QUANTIZED_BLOCK = 32


def quantized_operand(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | Quantized:
    """``data`` as the ops take it: a plain weight when ``scale`` is None, else the
    :class:`~deepinfer.hal.formats.Quantized` weight (format from the data's dtype, UE8M0 ``scale``
    per 32 along K)."""
    if scale is None:
        return data
    return Quantized(data, scale, "fp8" if data.dtype == torch.float8_e4m3fn else "mxfp4", QUANTIZED_BLOCK)


def quantized_parameters(weight: torch.Tensor, fmt: str) -> tuple[nn.Parameter, nn.Parameter]:
    """``(data, scale)`` parameters holding ``weight [..., N, K]`` as ``fmt`` (``"fp8"`` or
    ``"mxfp4"``, UE8M0 per 32 along K); exact when ``weight`` is representable in ``fmt``."""
    if fmt not in QUANTIZED_DATA:
        raise ValueError(f"a held-quantized weight is 'fp8' or 'mxfp4', got {fmt!r}")
    if weight.shape[-1] % QUANTIZED_BLOCK:
        raise ValueError(f"holding a weight as {fmt} needs K a multiple of {QUANTIZED_BLOCK}; "
                         f"got shape {tuple(weight.shape)}")
    packed = quantize(weight.detach().float(), fmt, QUANTIZED_BLOCK)
    return (nn.Parameter(packed.data.view(QUANTIZED_DATA[fmt]), requires_grad=False),
            nn.Parameter(packed.scale, requires_grad=False))


class Linear(nn.Module):
    """``y = x @ weight.T`` through the ``linear`` op (no bias: V4.1 has none), in ``x.dtype``.

    The weight is a plain ``[N, K]`` tensor, or after :meth:`hold_quantized` its e4m3 / packed
    e2m1 data with ``weight_scale`` (UE8M0 ``[N, K/32]``), passed to the op as
    :class:`~deepinfer.hal.formats.Quantized`."""

    def __init__(self, in_features: int, out_features: int, ops: OpTable, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.register_parameter("weight_scale", None)
        self.ops = ops

    def hold_quantized(self, fmt: str) -> None:
        """Keep the weight as ``fmt`` (``"fp8"`` or ``"mxfp4"``), encoded from its current values."""
        self.weight, self.weight_scale = quantized_parameters(self.weight, fmt)

    def operand(self, groups: int | None = None) -> torch.Tensor | Quantized:
        """The weight as the ops take it (plain or Quantized); with ``groups`` its rows split into
        ``[groups, N / groups, K]`` for a grouped GEMM."""
        data, scale = self.weight, self.weight_scale
        if groups is not None:
            data = data.view(groups, -1, data.shape[-1])
            scale = None if scale is None else scale.view(groups, -1, scale.shape[-1])
        return quantized_operand(data, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return self.ops.linear(x, self.weight)
        return self.ops.linear(x, self.operand()).to(x.dtype)


def stacked(ops: OpTable, x: torch.Tensor, weights: list, rope: tuple | None = None,
            norm: RMSNorm | None = None, keep_normed: bool = False, dtype: torch.dtype | None = None,
            swiglu: bool = False, swiglu_limit: float | None = None,
            out_dtype: torch.dtype | None = None, mxfp4_products: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """``x`` (or ``norm(x)``) through each of ``weights`` (:class:`Linear` modules or plain
    ``[N, K]`` tensors) in one ``stacked_linear`` call, each product in ``x.dtype`` (or ``dtype``,
    which the normalised input is rounded to) as :meth:`Linear.forward` gives it, or in
    ``out_dtype`` (float32: the op's unrounded accumulator, as the LM head writes its logits).
    ``rope``: ``(positions, cos_sin, head width per weight)``, the op's RoPE of the products' heads;
    ``norm``: the op's RMSNorm of its input, which ``keep_normed`` appends to the products;
    ``swiglu``: the last two weights' SwiGLU (clamped at ``swiglu_limit``) replaces their products;
    ``mxfp4_products``: the products the op casts through MXFP4."""
    operands = [w.operand() if isinstance(w, Linear) else w for w in weights]
    kwargs = {} if norm is None else {"norm_weight": norm.weight, "norm_eps": norm.eps, "keep_normed": keep_normed}
    if dtype is not None and dtype != x.dtype:
        kwargs["norm_dtype"] = dtype
    if rope is not None:
        kwargs.update(zip(("positions", "cos_sin", "rope_heads"), rope))
    if swiglu:
        kwargs.update(swiglu=True, swiglu_limit=swiglu_limit)
    if mxfp4_products:
        kwargs["mxfp4_products"] = tuple(mxfp4_products)
    if out_dtype is not None:
        return ops.stacked_linear(x, operands, out_dtype=out_dtype, **kwargs)
    return tuple(y.to(dtype or x.dtype) for y in ops.stacked_linear(x, operands, **kwargs))


class RMSNorm(nn.Module):
    """RMSNorm through the ``rms_norm`` op; with ``residual`` returns ``(normed, new_residual)``."""

    def __init__(self, dim: int, eps: float, ops: OpTable, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
