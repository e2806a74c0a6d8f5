"""MoE gate: sqrt-softplus scores, noaux_tc bias for selection, normalized routed weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.hal.spec import OpCase, OpSpec, register

WEIGHT_SUM_EPS = 1e-20


def moe_gate(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scale: float):
    """Pick ``top_k`` experts per token; returns ``(weights float32 [T, k], ids int64 [T, k])``.

    ``logits``: float ``[T, E]`` (the gate GEMM output); ``bias``: float ``[E]`` or ``None``
    (``e_score_correction_bias``). Scores are ``sqrt(softplus(logits))``; experts are chosen by
    ``score + bias`` (the bias only steers selection), largest first, equal values broken by the
    lower expert id, and ``ids`` are listed in that order. ``weights`` are the chosen experts'
    unbiased scores divided by ``(their sum + 1e-20)``, times ``routed_scale``."""
    check_gate_args(logits, bias, top_k)
    scores = torch.sqrt(F.softplus(logits.float()))
    selection = scores if bias is None else scores + bias.float()
    order = torch.sort(selection, dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    chosen = scores.gather(1, ids)
    weights = chosen / (chosen.sum(dim=-1, keepdim=True) + WEIGHT_SUM_EPS) * routed_scale
    return weights, ids


def check_gate_args(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [T, E] tensor, got {logits.dtype} "
                         f"of shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if bias is not None and bias.shape != (experts,):
        raise ValueError(f"bias must have shape [E={experts}], got {tuple(bias.shape)}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must lie in [1, E={experts}], got {top_k}")


def _case(tokens: int, experts: int, top_k: int, with_bias: bool = True, tied: bool = False):
    def make(gen: torch.Generator, device: torch.device):
        if tied:
            logits = torch.randint(-1, 2, (tokens, experts), generator=gen).float()
        else:
            logits = 2 * torch.randn(tokens, experts, generator=gen)
        bias = 0.1 * torch.randn(experts, generator=gen) if with_bias else None
        return {
            "logits": logits.to(device),
            "bias": None if bias is None else bias.to(device),
            "top_k": top_k,
            "routed_scale": 1.5,
        }
    return make


register(OpSpec(
    name="moe_gate",
    activations=False,
    summary="sqrtsoftplus MoE gate with noaux_tc bias: top-k expert ids and routed weights",
    reference=moe_gate,
    cases=(
        OpCase("tiny", _case(5, 8, 2)),
        OpCase("tiny_no_bias", _case(4, 8, 3, with_bias=False)),
        OpCase("tiny_ties", _case(6, 8, 3, with_bias=False, tied=True)),
        OpCase("v41_routed", _case(32, 384, 6), size="real"),
        OpCase("v4_routed", _case(32, 256, 6), size="real"),
        OpCase("v41_ties", _case(32, 384, 6, with_bias=False, tied=True), size="real"),
    ),
))
