"""RMSNorm, optionally fused with a residual add."""
from __future__ import annotations

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, computed in float32, returned in ``x.dtype``.

    With ``residual``: ``s = x + residual`` first, rounded to ``residual.dtype`` (the new
    residual stream); returns ``(rms_norm(s) * weight, s)``, the norm taken of the rounded ``s``
    as DeepInfer takes it."""
    if residual is not None:
        summed = (x.float() + residual.float()).to(residual.dtype)
        return _normalize(summed.float(), weight, eps).to(x.dtype), summed
    return _normalize(x.float(), weight, eps).to(x.dtype)


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def _case(rows: int, dim: int, with_residual: bool, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        args = {
            "x": torch.randn(rows, dim, generator=gen).to(device, dtype),
            "weight": (1 + 0.1 * torch.randn(dim, generator=gen)).to(device),
            "eps": 1e-6,
        }
        if with_residual:
            args["residual"] = torch.randn(rows, dim, generator=gen).to(device, dtype)
        return args
    return make


register(OpSpec(
    name="rms_norm",
    summary="RMSNorm (+ residual add) over the last dim",
    reference=rms_norm,
    cases=(
        OpCase("tiny", _case(5, 64, False)),
        OpCase("tiny_residual", _case(5, 64, True)),
        OpCase("tiny_bf16_residual", _case(7, 96, True, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_hidden", _case(64, 4096, True), size="real"),
        OpCase("v41_latent", _case(128, 512, False), size="real"),
        OpCase("v41_q_lora", _case(32, 1280, False), size="real"),
        OpCase("v41_hidden_bf16", _case(64, 4096, True, torch.bfloat16), size="real", dtype=torch.bfloat16),
        OpCase("v41_latent_bf16", _case(128, 512, False, torch.bfloat16), size="real", dtype=torch.bfloat16),
    ),
))
