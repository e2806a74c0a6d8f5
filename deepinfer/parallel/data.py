"""Attention data parallelism: each rank is an engine of its own (scheduler, caches, the whole
model but for the experts it does not hold) and takes every ``world``-th request of a ``generate``
call; the outputs come back to every rank in the prompts' order. With the experts replicated the
ranks' forwards share nothing and run their steps independently. Combined with expert
parallelism every forward's MoE layers exchange rows with every rank, so the ranks step in
lockstep (:func:`agree`): a rank with nothing to run while another runs a forward runs a
placeholder pass (:func:`placeholder_pass`) that sends no rows and computes the experts it holds
for the rows the others send. With DSpark every forward is followed by a draft pass on every
rank, a placeholder one where the rank has nothing to draft."""
from __future__ import annotations

from typing import Iterable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


def gather_in_order(mine: list[T], count: int, rank: int, world: int, group) -> list[T]:
    """Every rank's results of its share of ``count`` items (rank ``r`` holds items ``r``,
    ``r + world``, ...), back in the items' order, on every rank."""
    parts: list = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    out: list = [None] * count
    for r, part in enumerate(parts):
        if len(part) != len(range(r, count, world)):
            raise RuntimeError(f"rank {r} returned {len(part)} outputs for its {len(range(r, count, world))} requests")
        out[r::world] = part
    return out


def agree(unfinished: bool, forward: bool, group) -> tuple[bool, bool]:
    """``(some rank has unfinished requests, some rank runs a forward this step)`` over ``group``."""
    flags = torch.tensor([int(unfinished), int(forward)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return bool(flags[0]), bool(flags[1])


def placeholder_pass(layers: Iterable[nn.Module]) -> None:
    """One pass's MoE exchanges without tokens over ``layers`` (the backbone's, for a target
    forward; the DSpark draft layers', for a draft pass): each layer's MoE, in order, routes no
    rows of its own and computes its experts for the rows the other ranks send."""
    for layer in layers:
        moe = layer.ffn
        reference = moe.shared_experts.w1.weight
        x = torch.zeros(0, moe.gate.weight.shape[1], dtype=reference.dtype, device=reference.device)
        ids = torch.zeros(0, moe.top_k, dtype=torch.int64, device=reference.device)
        weights = torch.zeros(0, moe.top_k, dtype=torch.float32, device=reference.device)
        moe._routed(x, torch.zeros_like(x), weights=weights, ids=ids)
