"""Manifold hyper-connection parameters of one sublayer and the shifted mixing step."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.registry import OpTable


class HyperConnection(nn.Module):
    """``fn [hc*(2+hc), hc*H]``, ``base [hc*(2+hc)]``, ``scale [3]`` of one sublayer (float32).

    The owning block registers them under the official names ``hc_{attn,ffn}_{fn,base,scale}``."""

    def __init__(self, hidden: int, streams: int, norm_eps: float, hc_eps: float, sinkhorn_iters: int, ops: OpTable,
                 sinkhorn_order: str = "deepinfer"):
        super().__init__()
        mixes = streams * (2 + streams)
        self.fn = nn.Parameter(torch.zeros(mixes, streams * hidden), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(mixes), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)
        self.norm_eps, self.hc_eps, self.sinkhorn_iters, self.ops = norm_eps, hc_eps, sinkhorn_iters, ops
        self.sinkhorn_order = sinkhorn_order

    def mixes(self, residual: torch.Tensor):
        """``(pre, post, comb)`` of this sublayer, computed from the trunk entering it."""
        return self.ops.mhc_mixes(residual, self.fn, self.scale, self.base, self.norm_eps, self.hc_eps,
                                  self.sinkhorn_iters, sinkhorn_order=self.sinkhorn_order)

    def run(self, residual: torch.Tensor, input_pre: torch.Tensor | None, sublayer,
            x: torch.Tensor | None = None, norm=None, next_norm=None,
            post_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Apply ``sublayer`` on the trunk; returns ``(new trunk, this sublayer's pre mix, next
        sublayer's input)``.

        Shifted HC reads the sublayer input with ``input_pre`` (the previous sublayer's pre mix):
        ``x`` when the previous sublayer gave it, else read here; the next sublayer reads the new
        trunk with this sublayer's pre mix, so that input comes with the new trunk
        (``mhc_post_pre``). With ``input_pre=None`` (non-shifted) the sublayer reads with its own
        pre mix and the next input is None.

        ``norm`` (an :class:`~deepinfer.models.layers.RMSNorm`): the sublayer is fed its input
        normalised by it (normalised here when read here; a given ``x`` comes normalised by it).
        ``next_norm``: the norm of the next sublayer's input, which the shifted step returns
        normalised (``mhc_post_pre`` normalises it in the same pass). ``post_only``: the shifted
        step stops after the post mix and returns no next input, for a trunk that changes before
        the next sublayer reads it (Engram's injection)."""
        pre, post, comb = self.mixes(residual)
        if input_pre is None:
            x = self.ops.mhc_pre(residual, pre)
            return self.ops.mhc_post(sublayer(x if norm is None else norm(x)), residual, post, comb), pre, None
        if x is None:
            x = self.ops.mhc_pre(residual, input_pre)
            x = x if norm is None else norm(x)
        if post_only:
            return self.ops.mhc_post(sublayer(x), residual, post, comb), pre, None
        normed = {} if next_norm is None else {"norm_weight": next_norm.weight, "norm_eps": next_norm.eps}
        residual, next_x = self.ops.mhc_post_pre(sublayer(x), residual, post, comb, pre, **normed)
        return residual, pre, next_x


def first_stream_mix(tokens: int, streams: int, device: torch.device) -> torch.Tensor:
    """One-hot pre mix on stream 0: what the first shifted sublayer reads with."""
    pre = torch.zeros(tokens, streams, device=device)
    pre[:, 0] = 1.0
    return pre
