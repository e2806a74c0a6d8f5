"""Engram gate: each hyper-connection stream takes the fetched memory value, weighted by how
well its own normalised state matches that stream's memory key."""
from __future__ import annotations

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register

CLAMP = 1e-6
"""Smallest magnitude the signed square root of the gate score is taken of."""


def engram_gate(residual: torch.Tensor, kv: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                eps: float, clamp: float = CLAMP) -> torch.Tensor:
    """The trunk after Engram's injection, ``[T, hc, H]`` in ``residual.dtype``.

    ``residual [T, hc, H]`` holds the streams ``x_m``; ``kv [T, hc + 1, H]`` a key ``k_m`` per
    stream and the shared value ``v`` last; ``weight_hidden``, ``weight_embed`` ``[hc, H]`` are
    the RMSNorm weights of the streams and of the keys. Stream ``m`` becomes ``x_m + g_m * v``
    with ``g_m = sigmoid(ssqrt(<rms(x_m) * weight_hidden[m], rms(k_m) * weight_embed[m]> /
    sqrt(H)))``, where ``rms`` divides by the root mean square (``eps`` added to the mean
    square) and ``ssqrt(s) = sign(s) * sqrt(max(|s|, clamp))``. Float32 math."""
    tokens, streams, hidden = _check(residual, kv, weight_hidden, weight_embed)
    x, key, value = residual.float(), kv[:, :streams].float(), kv[:, streams].float()
    inv_rms_x = torch.rsqrt(x.pow(2).mean(dim=-1) + eps)
    inv_rms_k = torch.rsqrt(key.pow(2).mean(dim=-1) + eps)
    fused = weight_hidden.float() * weight_embed.float()
    score = (x * key * fused).sum(dim=-1) * inv_rms_x * inv_rms_k * hidden ** -0.5
    gate = torch.sigmoid(torch.sign(score) * score.abs().clamp(min=clamp).sqrt())
    return (x + gate[:, :, None] * value[:, None, :]).to(residual.dtype)


def _check(residual, kv, weight_hidden, weight_embed) -> tuple[int, int, int]:
    if residual.dim() != 3:
        raise ValueError(f"residual must be [T, hc, H], got shape {tuple(residual.shape)}")
    tokens, streams, hidden = residual.shape
    expected = {"kv": (kv, (tokens, streams + 1, hidden)), "weight_hidden": (weight_hidden, (streams, hidden)),
                "weight_embed": (weight_embed, (streams, hidden))}
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} for residual {list(residual.shape)}, got "
                             f"{list(tensor.shape)}")
    return tokens, streams, hidden


def _case(tokens: int, streams: int, hidden: int, dtype=torch.float32, zero_keys: int = 0):
    def make(gen: torch.Generator, device: torch.device):
        kv = torch.randn(tokens, streams + 1, hidden, generator=gen)
        kv[:zero_keys, :streams] = 0.0  # a score of 0: its sign is 0 and the gate 1/2
        return {"residual": torch.randn(tokens, streams, hidden, generator=gen).to(device, dtype),
                "kv": kv.to(device, dtype),
                "weight_hidden": (1 + 0.1 * torch.randn(streams, hidden, generator=gen)).to(device, dtype),
                "weight_embed": (1 + 0.1 * torch.randn(streams, hidden, generator=gen)).to(device, dtype),
                "eps": 1e-6}
    return make


register(OpSpec(
    name="engram_gate",
    summary="Engram gate: x_m + sigmoid(ssqrt(<rms(x_m) wh_m, rms(k_m) we_m> / sqrt(H))) v per stream",
    reference=engram_gate,
    cases=(
        OpCase("tiny", _case(7, 4, 64)),
        OpCase("tiny_zero_keys", _case(5, 4, 32, zero_keys=2)),
        OpCase("tiny_bf16", _case(6, 4, 96, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_decode", _case(64, 4, 4096), "real"),
        OpCase("v41_decode_bf16", _case(64, 4, 4096, torch.bfloat16), "real", dtype=torch.bfloat16),
    ),
))
