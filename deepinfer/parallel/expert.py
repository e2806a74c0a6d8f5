"""Expert parallelism: each rank keeps a contiguous share of every MoE's routed experts and the
MoE's dispatch and combine move the tokens' rows to their experts' owners and back
(``ep_dispatch`` / ``ep_combine`` over the expert group). The shared expert, the gate and
everything outside the routed experts stay whole on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def local_experts(num_experts: int, world: int, rank: int) -> range:
    """The global ids of the experts ``rank`` of ``world`` owns: a contiguous ``1/world`` share."""
    if num_experts % world:
        raise ValueError(f"{num_experts} routed experts do not divide over {world} expert-parallel ranks; pick an "
                         f"expert_parallel that divides every MoE's expert count (the draft layers' too)")
    share = num_experts // world
    return range(rank * share, (rank + 1) * share)


def shard_experts(model: nn.Module, group) -> None:
    """Keep this rank's share (:func:`local_experts`) of every MoE's routed experts in ``model``
    (backbone and draft layers) and route its dispatch and combine through ``group``. The full
    model was built and loaded first; the other ranks' experts are freed here."""
    from deepinfer.models.deepseek_v41.moe import MoE

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        owned = local_experts(moe.num_experts, world, rank)
        experts = moe.experts
        for name in [*experts.PROJECTIONS, *(f"{p}_scale" for p in experts.PROJECTIONS)]:
            value = getattr(experts, name)
            if value is not None:
                setattr(experts, name, nn.Parameter(value.data[owned.start:owned.stop].clone(), requires_grad=False))
        moe.ep_group = group
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
