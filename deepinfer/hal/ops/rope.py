"""Rotary position embedding: frequency tables (base and YaRN) and the interleaved rotation.

V4.1 rotates the trailing 64 dims of each head with interleaved pairs. SWA-only and draft layers
use plain RoPE with ``rope_theta``; compressed layers and their indexer use YaRN with
``compress_rope_theta`` (mscale off)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

ROPE_DIM = 64


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-style YaRN context extension (the config's ``rope_scaling``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


def rope_inv_freq(theta: float, rope_dim: int = ROPE_DIM, yarn: YarnScaling | None = None) -> torch.Tensor:
    """Inverse frequencies ``1 / theta ** (2i / rope_dim)`` for pairs ``i < rope_dim / 2``, float32,
    formed in float32 as DeepInfer forms them (the tables of the official checkpoint):
    ``theta ** (2i / rope_dim)`` in float32, then its reciprocal.

    With ``yarn``: pair ``i`` gets ``1 / (factor * p_i) * ramp_i + 1 / p_i * (1 - ramp_i)`` for
    ``p_i = theta ** (2i / rope_dim)``, where the float32 ramp rises linearly from 0 at the
    correction dim of ``beta_fast`` rotations to 1 at that of ``beta_slow`` rotations over the
    original context (both clamped to ``[0, rope_dim - 1]``). Fast pairs keep their frequency
    (extrapolation); slow pairs are interpolated."""
    if theta <= 0:
        raise ValueError(f"theta must be positive, got {theta}")
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    periods = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if yarn is None:
        return 1.0 / periods
    if yarn.factor < 1:
        raise ValueError(f"yarn.factor must be >= 1, got {yarn.factor}")
    low = max(math.floor(_correction_dim(yarn.beta_fast, theta, rope_dim, yarn)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, theta, rope_dim, yarn)), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    return 1.0 / (yarn.factor * periods) * ramp + 1.0 / periods * (1.0 - ramp)


def _correction_dim(rotations: float, theta: float, rope_dim: int, yarn: YarnScaling) -> float:
    """Pair index whose wavelength fits ``rotations`` times into the original context."""
    context = yarn.original_max_position_embeddings
    return rope_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """Table ``[max_positions, rope_dim]`` float32 = ``cat(cos, sin)`` of ``position * inv_freq``.

    The angles are float32 products of float32 positions and frequencies, turned into cos and
    sin by ``torch.polar``, as DeepInfer builds its tables: far positions carry the float32
    rounding of their angles, as the official checkpoint's tables do."""
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be 1-D [rope_dim/2], got shape {tuple(inv_freq.shape)}")
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(positions, inv_freq.float())
    turns = torch.polar(torch.ones_like(angles), angles)
    return torch.cat([turns.real, turns.imag], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, conjugate: bool = False,
               out: torch.Tensor | None = None):
    """Rotate the trailing ``R = cos_sin.shape[1]`` dims (64 in V4.1) of ``x``'s last axis.

    ``x``: ``[T, ..., D]`` with ``D >= R``; ``positions``: int64 ``[T]`` in ``[0, P)``;
    ``cos_sin``: float32 ``[P, R]`` from :func:`rope_cos_sin`. Pairs are interleaved: within the
    rotated slice, ``(x[2i], x[2i+1])`` turns by ``positions[t] * inv_freq[i]`` (by its negative
    when ``conjugate``, which undoes the rotation). Dims before the slice are returned untouched;
    middle axes (heads) share the token's angle. Computed in float32, returned in ``x.dtype``.

    ``out`` (``x``'s shape and dtype; it may be ``x`` itself, or a strided view such as the tail
    of each head): the result is written there and ``out`` is returned."""
    check_rope_args(x, positions, cos_sin, out)
    rope_dim = cos_sin.shape[1]
    table = cos_sin[positions].float().reshape(x.shape[0], *([1] * (x.dim() - 2)), rope_dim)
    cos, sin = table[..., : rope_dim // 2], table[..., rope_dim // 2:]
    if conjugate:
        sin = -sin
    pairs = x[..., x.shape[-1] - rope_dim:].float().unflatten(-1, (rope_dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    result = torch.cat([x[..., : x.shape[-1] - rope_dim], rotated.to(x.dtype)], dim=-1)
    return result if out is None else out.copy_(result)


def check_rope_args(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                    out: torch.Tensor | None = None) -> None:
    """The checks of :func:`apply_rope`'s arguments (the positions' range under value checks)."""
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must match x ({x.dtype} {tuple(x.shape)} on {x.device}), got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or not cos_sin.is_floating_point():
        raise ValueError(f"cos_sin must be a float [P, rope_dim] table with even rope_dim, "
                         f"got {cos_sin.dtype} of shape {tuple(cos_sin.shape)}")
    if x.dim() < 2 or x.shape[-1] < cos_sin.shape[1]:
        raise ValueError(f"x must be [T, ..., D] with D >= rope_dim={cos_sin.shape[1]}, "
                         f"got shape {tuple(x.shape)}")
    if positions.dtype != torch.int64 or positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be int64 [T={x.shape[0]}], got {positions.dtype} of shape "
                         f"{tuple(positions.shape)}")
    if value_checks() and positions.numel() and (positions.min() < 0 or positions.max() >= cos_sin.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos_sin.shape[0]}) (the cos_sin table), got "
                         f"min {positions.min().item()} and max {positions.max().item()}")


def _case(tokens: int, middle: tuple[int, ...], dim: int, conjugate: bool = False,
          dtype=torch.float32, theta: float = 10000.0, yarn: YarnScaling | None = None, table: int = 256,
          tail_of: int | None = None, spare_heads: int = 0):
    """``tail_of``: ``x`` is the trailing ``dim`` columns of a wider tensor (evenly spaced rows);
    ``spare_heads``: of a tensor with that many more heads, too (rows not evenly spaced)."""
    def make(gen: torch.Generator, device: torch.device):
        wide = torch.randn(tokens, *middle[:-1], *[m + spare_heads for m in middle[-1:]], tail_of or dim,
                           generator=gen).to(device, dtype)
        return {
            "x": wide[..., :middle[-1], wide.shape[-1] - dim:] if middle else wide[..., wide.shape[-1] - dim:],
            "positions": torch.randint(0, table, (tokens,), generator=gen).to(device),
            "cos_sin": rope_cos_sin(rope_inv_freq(theta, yarn=yarn), table).to(device),
            "conjugate": conjugate,
        }
    return make


_V41_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)

register(OpSpec(
    name="apply_rope",
    summary="interleaved RoPE on the trailing 64 dims (optionally conjugate), base or YaRN table",
    reference=apply_rope,
    cases=(
        OpCase("tiny", _case(5, (), 96)),
        OpCase("tiny_heads", _case(4, (3,), 128)),
        OpCase("tiny_conjugate", _case(4, (3,), 128, conjugate=True)),
        OpCase("tiny_bf16", _case(6, (2,), 64, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_tail_slice", _case(4, (3,), 64, conjugate=True, tail_of=160)),
        OpCase("tiny_uneven_rows", _case(4, (3,), 96, tail_of=160, spare_heads=2)),
        OpCase("v41_query_tail_bf16", _case(16, (64,), 64, dtype=torch.bfloat16, tail_of=512), size="real",
               dtype=torch.bfloat16),
        OpCase("v41_query", _case(16, (64,), 512), size="real"),
        OpCase("v41_yarn_key", _case(16, (), 512, theta=160000.0, yarn=_V41_YARN, table=1 << 16),
               size="real"),
    ),
))
