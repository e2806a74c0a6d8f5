"""Activations cast to FP8 for a block-scaled GEMM: DeepInfer's per-token cast.

Each row's values go to e4m3 in blocks of 32 along the last dim, one UE8M0 scale byte per block,
exactly as :func:`deepinfer.hal.formats.quantize` writes ``"fp8"``: the block's magnitude max,
raised to :data:`~deepinfer.hal.formats.FP8_AMAX_FLOOR`, gives the least power of two at or above
``max / 448``; the values are multiplied by its reciprocal (exact) and rounded to the nearest
e4m3, ties to even, keeping the sign of a value that rounds to zero. The result feeds the
``linear``, ``grouped_gemm`` and ``grouped_swiglu`` ops as their ``x``. A ``row_scale``
multiplies each row first, in float32: the routed experts' router weights, which DeepInfer
applies to the SwiGLU's products ahead of this cast."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized, quantize
from deepinfer.hal.ops.grouped_gemm import ACTIVATION_FORMATS, BLOCK
from deepinfer.hal.spec import OpCase, OpSpec, Tolerance, register


def quantize_activations(x: torch.Tensor, fmt: str = "fp8", row_scale: torch.Tensor | None = None) -> Quantized:
    """``x [..., K]`` (a float tensor, ``K`` a multiple of 32) as :class:`Quantized` ``fmt``
    (``"fp8"``): e4m3 data ``[..., K]`` and UE8M0 scale bytes ``uint8 [..., K / 32]``, the bytes of
    :func:`~deepinfer.hal.formats.quantize`. Each row depends on its own values only. A block
    holding an infinity or NaN gets bytes no reader can use; backends may differ there.
    ``row_scale`` (float32 ``[...]``): each row is the float32 product ``x.float() * row_scale``,
    rounded once, by the cast."""
    check_quantize_activations(x, fmt, row_scale)
    if row_scale is not None:
        x = x.float() * row_scale[..., None]
    return quantize(x, fmt, BLOCK)


def check_quantize_activations(x: torch.Tensor, fmt: str, row_scale: torch.Tensor | None = None) -> None:
    """The checks of :func:`quantize_activations`' arguments."""
    if fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"quantize_activations casts to {list(ACTIVATION_FORMATS)}, got fmt={fmt!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"quantize_activations takes a float tensor [..., K], got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else f'{x.dtype} {tuple(x.shape)}'}")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"quantize_activations needs K (the last dim) a multiple of {BLOCK}, got "
                         f"{tuple(x.shape)}; pad the rows or keep them in the model dtype")
    if row_scale is not None and (not isinstance(row_scale, torch.Tensor) or row_scale.dtype != torch.float32
                                  or tuple(row_scale.shape) != tuple(x.shape[:-1])
                                  or row_scale.device != x.device):
        got = (f"{row_scale.dtype} {tuple(row_scale.shape)} on {row_scale.device}"
               if isinstance(row_scale, torch.Tensor) else type(row_scale).__name__)
        raise ValueError(f"row_scale must be a float32 tensor {tuple(x.shape[:-1])} (one per row of x) on "
                         f"{x.device}, got {got}")


def _rows(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, spread: int = 12, scaled: bool = False):
    """Normal values whose 32-value blocks span ``2 ** -spread`` to ``2 ** spread`` in magnitude,
    with a zero block, a block of tiny values (their e4m3 codes subnormal), negative zeros and
    exact ties of e4m3's rounding, so every branch of the cast is taken. ``scaled``: with a
    ``row_scale`` of router-like weights in (0, 1], one of them zero and one exactly 1."""
    def make(gen: torch.Generator, device: torch.device):
        x = torch.randn(*shape, generator=gen)
        blocks = x.reshape(-1, shape[-1] // BLOCK, BLOCK)
        exponents = torch.randint(-spread, spread + 1, blocks.shape[:2], generator=gen).float()
        blocks.mul_(torch.exp2(exponents)[..., None])
        if blocks.shape[0] and blocks.shape[1] > 2:
            blocks[0, 0] = 0.0
            blocks[0, 1] = torch.where(torch.arange(BLOCK) % 2 == 0, -0.0, 2.0 ** -30)
            blocks[0, 2, :8] = torch.tensor([448.0, -448.0, 1.0625, -1.1875, 2.0 ** -7 * 1.125, 2.0 ** -8 * 3,
                                             2.0 ** -10, -(2.0 ** -10) * 3])  # ties: to even code
        args = {"x": x.to(device=device, dtype=dtype)}
        if scaled:
            weights = torch.rand(shape[:-1], generator=gen)
            weights.view(-1)[:2] = torch.tensor([1.0, 0.0])[:weights.numel()]
            args["row_scale"] = weights.to(device)
        return args
    return make


EXACT = Tolerance(0.0, 0.0)
"""The cast is defined bit for bit: every backend writes the reference's codes and scales."""

register(OpSpec(
    name="quantize_activations",
    summary="activations to FP8 e4m3 with one UE8M0 scale per 32 values of a row (DeepInfer's per-token cast)",
    reference=quantize_activations,
    cases=(
        OpCase("tiny", _rows((5, 128)), tolerance=EXACT),
        OpCase("tiny_3d", _rows((2, 3, 96)), tolerance=EXACT),
        OpCase("no_rows", _rows((0, 64)), tolerance=EXACT),
        OpCase("tiny_bf16", _rows((7, 160), torch.bfloat16), dtype=torch.bfloat16, tolerance=EXACT),
        # the SwiGLU's float32 products beside bf16 activations (what the routed experts cast)
        OpCase("float32_rows_bf16", _rows((9, 256)), dtype=torch.bfloat16, tolerance=EXACT),
        OpCase("wide_spread_bf16", _rows((4, 512), torch.bfloat16, spread=60), dtype=torch.bfloat16,
               tolerance=EXACT),
        OpCase("tiny_row_scale", _rows((6, 96), scaled=True), tolerance=EXACT),
        OpCase("row_scale_3d_bf16", _rows((2, 3, 64), torch.bfloat16, scaled=True), dtype=torch.bfloat16,
               tolerance=EXACT),
        OpCase("v41_routed_rows_bf16", _rows((512, 4096), torch.bfloat16), "real", torch.bfloat16, EXACT),
        OpCase("v41_routed_hidden_bf16", _rows((512, 2048)), "real", torch.bfloat16, EXACT),
        OpCase("v41_weighted_hidden_bf16", _rows((512, 2048), scaled=True), "real", torch.bfloat16, EXACT),
    ),
))
