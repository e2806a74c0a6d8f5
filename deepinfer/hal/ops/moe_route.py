"""MoE routing in one op: the gate's picks (``moe_gate``) and the dispatch of the chosen pairs
(``ep_dispatch``), so that a backend can keep the picks on the chip between the two."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.all_to_all import ep_dispatch
from deepinfer.hal.ops.routing import moe_gate
from deepinfer.hal.spec import OpCase, OpSpec, register


def moe_route(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scale: float,
              group=None):
    """:func:`~deepinfer.hal.ops.routing.moe_gate` of ``logits [T, E]``, then
    :func:`~deepinfer.hal.ops.all_to_all.ep_dispatch` of ``x [T, H]`` by its picks over the ``E``
    experts: ``(weights float32 [T, k], ids int64 [T, k], expanded, group_sizes, handle)``."""
    weights, ids = moe_gate(logits, bias, top_k, routed_scale)
    return (weights, ids) + ep_dispatch(x, ids, weights, logits.shape[1], group)


def _case(tokens: int, hidden: int, experts: int, top_k: int, dtype=torch.float32, tied: bool = False):
    def make(gen: torch.Generator, device: torch.device):
        if tied:
            logits = torch.randint(-1, 2, (tokens, experts), generator=gen).float()
        else:
            logits = 2 * torch.randn(tokens, experts, generator=gen)
        return {"x": torch.randn(tokens, hidden, generator=gen).to(device, dtype), "logits": logits.to(device),
                "bias": (0.1 * torch.randn(experts, generator=gen)).to(device), "top_k": top_k, "routed_scale": 1.5}
    return make


register(OpSpec(
    name="moe_route",
    summary="MoE gate picks, then the dispatch of the picked (token, expert) pairs",
    reference=moe_route,
    cases=(
        OpCase("tiny", _case(5, 16, 8, 2)),
        OpCase("tiny_bf16", _case(4, 32, 6, 2, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_ties_bf16", _case(6, 40, 8, 3, torch.bfloat16, tied=True), dtype=torch.bfloat16),
        OpCase("many_pairs_bf16", _case(40, 64, 16, 4, torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_decode_bf16", _case(8, 4096, 384, 6, torch.bfloat16), "real", dtype=torch.bfloat16),
        OpCase("small_decode_bf16", _case(1, 4096, 16, 6, torch.bfloat16), "real", dtype=torch.bfloat16),
    ),
))
