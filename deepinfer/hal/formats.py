"""Number formats of V4.1 weights and caches, emulated exactly in PyTorch.

FP8 is e4m3 (max 448), FP4 is e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, two
per byte with the even index in the low nibble). Scales are UE8M0 (a power of two stored as the
biased exponent byte, value ``2 ** (byte - 127)``) or, for the FP4 KV format, e4m3 bytes.
Every function works on any device and leading batch shape; the last dim is the quantized one.
Encoders write DeepInfer 0.1.0's bytes (its ``tile_kernels`` casts and KV-cache reference): a
block's max is floored before its scale is taken, values are multiplied by the float32 reciprocal
of the scale, and an e2m1 code keeps the sign bit of a value that rounds to zero.

Cache token layouts (one row of bytes per token, data then scales):

=============  ======  ===============================================
format         bytes   layout
=============  ======  ===============================================
``bf16``       1024    512 x bf16
``fp8``        528     512 x e4m3, 16 x UE8M0 (one per 32)
``fp4``        288     256 B packed e2m1, 32 x e4m3 scales (one per 16)
``index_fp4``  68      64 B packed e2m1 (128 values), 4 x UE8M0 (per 32)
=============  ======  ===============================================
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
"""Least block max an ``fp8`` (e4m3, UE8M0) scale is taken from: a zero block gets byte 105 (2^-22)."""
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126
"""Least block max an ``mxfp4`` (e2m1, UE8M0) scale is taken from: a zero block gets byte 1 (2^-126)."""
NVFP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -9
"""Least block max an ``nvfp4`` (e2m1, e4m3 scale) scale is taken from: the scale is at least 2^-9,
e4m3's smallest positive value."""


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def ue8m0_scale(amax: torch.Tensor, fmt_max: float, amax_floor: float) -> torch.Tensor:
    """UE8M0 byte (uint8) of the least power of two at or above ``max(amax, amax_floor) / fmt_max``.

    The quotient is a float32 division; its power of two is read from its bits (exact, no
    ``log2``), so a quotient one ulp above ``2^k`` gets ``2^(k+1)``. With a positive
    ``amax_floor`` a zero block gets the floor's scale, never a special value."""
    clamped = amax.float().clamp_min(amax_floor)
    ratio = clamped / torch.full_like(clamped, fmt_max)  # a true division (CUDA turns `/ scalar` into `* 1/scalar`)
    bits = ratio.view(torch.int32)
    return (((bits - 1) >> 23) + 1).to(torch.uint8)


def ue8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Value of UE8M0 bytes as float32 powers of two."""
    return torch.exp2(scale_bytes.float() - 127.0)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (nearest even), saturating at +-448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8) of ``x``: magnitude rounded to nearest, ties to the even code,
    saturating at 6 (NaN too); bit 3 is ``x``'s sign bit, so ``-0.0`` and negatives that round to
    zero give ``0x8``."""
    a = torch.nan_to_num(x.float().abs(), nan=E2M1_MAX)
    magnitude = (
        (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
        + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    ).to(torch.uint8)
    return magnitude | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes."""
    magnitude = torch.arange(8, device=codes.device)  # the grid, made on the device (no host copy)
    exponent, half = magnitude >> 1, (magnitude & 1).float() * 0.5
    grid = torch.where(exponent == 0, half, torch.exp2((exponent - 1).float()) * (1 + half))
    value = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -value, value)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack pairs of 4-bit codes into bytes, the even index in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@dataclass(frozen=True)
class Quantized:
    """Block-quantized tensor: ``data`` (e4m3, or packed e2m1 as uint8) and its ``scale`` bytes.

    ``fmt`` is ``"fp8"`` (e4m3, UE8M0 per ``block`` along the last dim), ``"mxfp4"`` (e2m1,
    UE8M0 per ``block``) or ``"nvfp4"`` (e2m1, e4m3 scale per ``block``)."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: int = 32

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def quantize(x: torch.Tensor, fmt: str, block: int = 32) -> Quantized:
    """Quantize the last dim of ``x`` in blocks of ``block`` values, as DeepInfer 0.1.0 casts.

    A block's max is raised to the format's floor (:data:`FP8_AMAX_FLOOR`,
    :data:`MXFP4_AMAX_FLOOR`, :data:`NVFP4_AMAX_FLOOR`) before its scale is taken: ``fp8`` and
    ``mxfp4`` take :func:`ue8m0_scale`, ``nvfp4`` :func:`nvfp4_scale`. Values are multiplied by
    the float32 reciprocal of the scale (exact for a power of two, rounded for an e4m3 scale), then
    rounded to e4m3 (saturating) or e2m1 (:func:`e2m1_codes`)."""
    blocks = _blocks(x.float(), block)
    amax = blocks.abs().amax(dim=-1)
    if fmt == "fp8":
        scale = ue8m0_scale(amax, E4M3_MAX, FP8_AMAX_FLOOR)
        scale_value = ue8m0_to_float(scale)
    elif fmt == "mxfp4":
        scale = ue8m0_scale(amax, E2M1_MAX, MXFP4_AMAX_FLOOR)
        scale_value = ue8m0_to_float(scale)
    elif fmt == "nvfp4":
        scale_e4m3 = nvfp4_scale(amax)
        scale, scale_value = scale_e4m3.view(torch.uint8), scale_e4m3.float()
    else:
        raise ValueError(f"unknown quantized format {fmt!r}; use 'fp8', 'mxfp4' or 'nvfp4'")
    scaled = blocks * (1.0 / scale_value).unsqueeze(-1)
    if fmt == "fp8":
        return Quantized(to_e4m3(scaled).reshape(x.shape), scale, fmt, block)
    return Quantized(pack_nibbles(e2m1_codes(scaled).reshape(x.shape)), scale, fmt, block)


def nvfp4_scale(amax: torch.Tensor) -> torch.Tensor:
    """e4m3 scale (``float8_e4m3fn``) of blocks with max ``amax``: ``max(amax, 6 * 2^-9)`` times
    ``1 / 6`` (a float32 product, ``1 / 6`` rounded to float32), rounded to the nearest even e4m3
    (saturating at 448)."""
    return to_e4m3(amax.float().clamp_min(NVFP4_AMAX_FLOOR) * (1.0 / E2M1_MAX))


def dequantize(q: Quantized) -> torch.Tensor:
    """float32 values of a :class:`Quantized` tensor."""
    if q.fmt == "fp8":
        values = q.data.float()
        scale = ue8m0_to_float(q.scale)
    elif q.fmt in ("mxfp4", "nvfp4"):
        values = e2m1_values(unpack_nibbles(q.data))
        scale = ue8m0_to_float(q.scale) if q.fmt == "mxfp4" else q.scale.view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"unknown quantized format {q.fmt!r}")
    return (_blocks(values, q.block) * scale.unsqueeze(-1)).reshape(values.shape)


def cast_back(x: torch.Tensor, fmt: str, block: int = 32) -> torch.Tensor:
    """Quantize then dequantize: the values a reader of the quantized copy will see (float32)."""
    return dequantize(quantize(x, fmt, block))


def quantize_weight_fp8(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint FP8 weight: e4m3 ``[N, K]`` and one UE8M0 byte per ``block x block`` tile, each
    tile scaled as :func:`quantize` scales an ``fp8`` block (max floored at
    :data:`FP8_AMAX_FLOOR`, values times the exact reciprocal of the power of two)."""
    n, k = weight.shape
    pad_n, pad_k = -n % block, -k % block
    padded = torch.nn.functional.pad(weight.float(), (0, pad_k, 0, pad_n))
    tiles = padded.reshape((n + pad_n) // block, block, (k + pad_k) // block, block)
    scale = ue8m0_scale(tiles.abs().amax(dim=(1, 3)), E4M3_MAX, FP8_AMAX_FLOOR)
    scaled = tiles * (1.0 / ue8m0_to_float(scale))[:, None, :, None]
    data = to_e4m3(scaled.reshape(n + pad_n, k + pad_k)[:n, :k])
    return data, scale


def dequantize_weight_fp8(data: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """float32 weight from an e4m3 ``[N, K]`` tensor and its ``block x block`` UE8M0 scales."""
    n, k = data.shape
    full = ue8m0_to_float(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return data.float() * full[:n, :k]


@dataclass(frozen=True)
class TokenFormat:
    """A cache row layout: ``dim`` values stored in ``bytes_per_token`` bytes."""

    name: str
    dim: int
    bytes_per_token: int


TOKEN_FORMATS = {
    "bf16": TokenFormat("bf16", 512, 1024),
    "fp8": TokenFormat("fp8", 512, 528),
    "fp4": TokenFormat("fp4", 512, 288),
    "index_fp4": TokenFormat("index_fp4", 128, 68),
    "index_bf16": TokenFormat("index_bf16", 128, 256),
}


def token_format(name: str) -> TokenFormat:
    """Look up a cache token format by name."""
    try:
        return TOKEN_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown cache format {name!r}; known: {sorted(TOKEN_FORMATS)}") from None


def encode_tokens(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Encode ``x [n, dim]`` into cache rows ``uint8 [n, bytes_per_token]``."""
    spec = token_format(fmt)
    if x.shape[-1] != spec.dim:
        raise ValueError(f"format {fmt!r} stores {spec.dim} values per token, got {x.shape[-1]}")
    if fmt in ("bf16", "index_bf16"):
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    inner = {"fp8": ("fp8", 32), "fp4": ("nvfp4", 16), "index_fp4": ("mxfp4", 32)}[fmt]
    q = quantize(x, *inner)
    return torch.cat((q.data.view(torch.uint8), q.scale.view(torch.uint8)), dim=-1)


def decode_tokens(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Decode cache rows ``uint8 [n, bytes_per_token]`` into float32 ``[n, dim]``."""
    spec = token_format(fmt)
    if rows.shape[-1] != spec.bytes_per_token:
        raise ValueError(f"format {fmt!r} rows have {spec.bytes_per_token} bytes, got {rows.shape[-1]}")
    if fmt in ("bf16", "index_bf16"):
        return rows.contiguous().view(torch.bfloat16).float()
    inner_fmt, block = {"fp8": ("fp8", 32), "fp4": ("nvfp4", 16), "index_fp4": ("mxfp4", 32)}[fmt]
    data_bytes = spec.dim if inner_fmt == "fp8" else spec.dim // 2
    data, scale = rows[..., :data_bytes], rows[..., data_bytes:]
    if inner_fmt == "fp8":
        data = data.contiguous().view(torch.float8_e4m3fn)
    return dequantize(Quantized(data, scale.contiguous(), inner_fmt, block))
