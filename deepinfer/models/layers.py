"""Parameter-holding modules that compute only through HAL ops."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.registry import OpTable


class Linear(nn.Module):
    """``y = x @ weight.T`` through the ``linear`` op (no bias: V4.1 has none)."""

    def __init__(self, in_features: int, out_features: int, ops: OpTable, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm through the ``rms_norm`` op; with ``residual`` returns ``(normed, new_residual)``."""

    def __init__(self, dim: int, eps: float, ops: OpTable, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
