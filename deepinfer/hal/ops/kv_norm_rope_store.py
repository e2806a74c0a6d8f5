"""A cache key path in one op: RMSNorm, RoPE on the trailing dims, encode in a cache format, store.

V4.1 projects each token's SWA latent (``Wkv.A``, 512 values), normalises it, rotates its last 64
dims and stores it in the sequence's SWA ring in the cache format (FP8 e4m3 with UE8M0 per-32
scales by default). The compressed keys (``fp4``, 512 values) and the indexer's keys
(``index_fp4``, 128 values) take the same path. The op also returns what a reader of the cache
sees (the quantize-dequantize copy), so prefill attends to exactly the keys decode reads back.
Decode stores every token; prefill stores only the ring's recent tokens (slot ``-1`` for the
others) but attends to the returned copy of all of them."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import _random_cache, _slots, kv_cast, kv_store
from deepinfer.hal.ops.norm import rms_norm
from deepinfer.hal.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from deepinfer.hal.spec import OpCase, OpSpec, Tolerance, register


def kv_norm_rope_store(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       cos_sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fmt: str) -> torch.Tensor:
    """``keys = apply_rope(rms_norm(x, weight, eps), positions, cos_sin)`` stored as
    ``kv_store(cache, slots, keys, fmt)``; returns ``kv_cast(keys, fmt)`` in ``x.dtype``.

    ``x``: float ``[T, D]`` (``D`` the format's dim: 512, or 128 for ``index_fp4``); ``weight``
    ``[D]``; ``positions`` int64 ``[T]`` rows of ``cos_sin`` (float32 ``[P, R]``, the trailing
    ``R`` dims rotate); ``cache`` uint8 ``[..., bytes_per_token]``, written in place at flat rows
    ``slots`` (int64 ``[T]``; ``-1`` computes the row but does not store it; valid slots must be
    distinct). The result is bitwise that of the unfused ops."""
    spec = token_format(fmt)
    if x.dim() != 2 or x.shape[1] != spec.dim or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [T, {spec.dim}] for format {fmt!r}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if weight.shape != (spec.dim,):
        raise ValueError(f"weight must be [{spec.dim}] (the norm over x's last dim), got {tuple(weight.shape)}")
    keys = apply_rope(rms_norm(x, weight, eps), positions, cos_sin)
    kv_store(cache, slots, keys, fmt)
    return kv_cast(keys, fmt).to(x.dtype)


def _case(tokens: int, fmt: str, ring_rows: int, skipped: int, dtype=torch.float32, table: int = 256,
          theta: float = 10000.0):
    """``tokens`` latents (one all-zero row: an all-zero scale block) at random positions, stored
    at distinct random rows of a ``ring_rows``-row cache, ``skipped`` of them with slot -1."""
    def make(gen: torch.Generator, device: torch.device):
        dim = token_format(fmt).dim
        x = torch.randn(tokens, dim, generator=gen) * torch.exp2(torch.randint(-3, 4, (tokens, 1), generator=gen))
        x[0] = 0.0
        return {
            "x": x.to(device, dtype),
            "weight": (1 + 0.1 * torch.randn(dim, generator=gen)).to(device),
            "eps": 1e-6,
            "positions": torch.randint(0, table, (tokens,), generator=gen).to(device),
            "cos_sin": rope_cos_sin(rope_inv_freq(theta), table).to(device),
            "cache": _random_cache(gen, fmt, ring_rows, 1).reshape(ring_rows, -1).to(device),
            "slots": _slots(gen, tokens, ring_rows, skipped).to(device),
            "fmt": fmt,
        }
    return make


_ONE_E4M3_STEP = 2.0 ** -3
"""A backend sums the row's squares in its own order, so a bf16 rounding of a normed value may
flip, and with it (rarely) the e4m3 rounding of that value: one e4m3 step is at most 1/8 of the
value. An e2m1 code (``fp4``, ``index_fp4``) is farther from its neighbours than this allows, but
it flips only when the moved bf16 value also lies within one bf16 ulp of a code threshold, rarer
still (well under one value per case here). The stored bytes are checked exactly by the backends'
own self-checks."""

register(OpSpec(
    name="kv_norm_rope_store",
    summary="RMSNorm -> RoPE (trailing 64 dims) -> encode -> store at cache slots; returns the decoded copy",
    reference=kv_norm_rope_store,
    cases=(
        OpCase("tiny_fp8", _case(5, "fp8", 12, 1)),
        OpCase("tiny_bf16_cache", _case(5, "bf16", 12, 2)),
        OpCase("tiny_fp8_all_stored", _case(4, "fp8", 4, 0)),
        OpCase("tiny_fp8_bf16", _case(7, "fp8", 16, 2, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_bf16_cache_bf16", _case(6, "bf16", 16, 1, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_decode_fp8_bf16", _case(256, "fp8", 256 * 134 // 16, 0, torch.bfloat16, table=1 << 16),
               size="real", dtype=torch.bfloat16),
        OpCase("v41_prefill_fp8_bf16", _case(512, "fp8", 1024, 384, torch.bfloat16, table=4096),
               size="real", dtype=torch.bfloat16),
        OpCase("v41_prefill_fp8", _case(128, "fp8", 256, 64), size="real"),
        OpCase("tiny_fp4", _case(5, "fp4", 12, 1)),
        OpCase("tiny_index_fp4", _case(5, "index_fp4", 12, 1)),
        OpCase("tiny_fp4_bf16", _case(7, "fp4", 16, 2, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_index_fp4_bf16", _case(7, "index_fp4", 16, 2, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_compressed_fp4", _case(64, "fp4", 256, 0, table=1 << 16), size="real"),
        OpCase("v41_index_fp4", _case(64, "index_fp4", 256, 0, table=1 << 16), size="real"),
        OpCase("v41_compressed_fp4_bf16", _case(256, "fp4", 1024, 32, torch.bfloat16, table=1 << 16),
               size="real", dtype=torch.bfloat16),
        OpCase("v41_index_fp4_bf16", _case(256, "index_fp4", 1024, 32, torch.bfloat16, table=1 << 16),
               size="real", dtype=torch.bfloat16),
    ),
    tolerances={torch.float32: Tolerance(1e-4, _ONE_E4M3_STEP), torch.bfloat16: Tolerance(2e-2, _ONE_E4M3_STEP)},
))
