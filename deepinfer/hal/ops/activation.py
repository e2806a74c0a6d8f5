"""V4.1's clamped SwiGLU: the activation between an MLP's gate/up and down projections."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.hal.spec import OpCase, OpSpec, register


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None, dtype: torch.dtype | None = None):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``, computed in float32 and rounded once
    to ``dtype`` (default ``gate.dtype``); ``limit=None`` clamps nothing. ``gate`` and ``up``:
    the same shape, any float dtype."""
    check_swiglu_args(gate, up, limit)
    g, u = gate.float(), up.float()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (F.silu(g) * u).to(dtype or gate.dtype)


def check_swiglu_args(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> None:
    """The checks of :func:`swiglu`'s arguments."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if limit is not None and not limit > 0:
        raise ValueError(f"limit must be positive (or None: no clamping), got {limit!r}")


def _case(rows: int, width: int, limit: float | None, dtype=torch.float32, out=None):
    def make(gen: torch.Generator, device: torch.device):
        return {"gate": (8 * torch.randn(rows, width, generator=gen)).to(device, dtype),
                "up": (8 * torch.randn(rows, width, generator=gen)).to(device, dtype),
                "limit": limit, "dtype": out}
    return make


register(OpSpec(
    name="swiglu",
    summary="clamped SwiGLU in float32: silu(min(gate, limit)) * clamp(up, -limit, limit)",
    reference=swiglu,
    cases=(
        OpCase("tiny", _case(5, 24, 10.0)),
        OpCase("tiny_no_limit", _case(3, 40, None)),
        OpCase("tiny_bf16", _case(4, 1100, 10.0, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_float32_to_bf16", _case(6, 48, 7.0, torch.float32, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_routed", _case(64, 2048, 10.0, torch.float32, torch.bfloat16), size="real", dtype=torch.bfloat16),
    ),
))
