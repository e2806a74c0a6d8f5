"""EPLB's policy: redundant experts for the hot ones and their placement over the EP ranks, from
the routed-token counts of a window of steps (DeepInfer's ``rebalance_experts_global``, per MoE
layer).

1. Replica allocation: every logical expert starts with one replica; each extra physical slot goes,
   one at a time, to the expert whose extra replica leaves the smallest sum over the window's
   steps of the largest per-replica load (ties to the lower expert id).
2. Placement: the replicas, each carrying its expert's per-step load over its replica count, sorted
   by total load (largest first, stable), each put on the rank with free slots that leaves the
   smallest sum over the steps of the largest rank load (ties to the lower rank).
3. The maps: ``physical_to_logical [P]`` (rank ``r`` holds physical slots ``r * P/ranks ..``),
   ``logical_to_physical [N, max replicas]`` (-1 padded) and ``logical_count [N]``; a token's
   replica is :func:`replica_of`.

:class:`~deepinfer.parallel.expert.ExpertMap` applies it at run time."""
from __future__ import annotations

from dataclasses import dataclass

import torch

LARGE_PRIME = 1_000_003
"""The token-index multiplier of :func:`replica_of`."""


@dataclass(frozen=True)
class Placement:
    """One MoE layer's EPLB maps (int64 tensors) over ``ranks`` ranks."""

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_count: torch.Tensor
    ranks: int

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """``[steps, ranks]`` tokens each rank's replicas take when each expert's tokens of
        ``loads [steps, N]`` split evenly over its replicas."""
        per_replica = loads.double() / self.logical_count.double()
        slots = per_replica[:, self.physical_to_logical]
        return slots.view(loads.shape[0], self.ranks, -1).sum(dim=-1)

    def imbalance(self, loads: torch.Tensor) -> float:
        """The largest rank load over the mean (:meth:`rank_loads`), each summed over the steps."""
        per_rank = self.rank_loads(loads)
        return float(per_rank.max(dim=1).values.sum() / per_rank.mean(dim=1).sum())


def allocate_replicas(loads: torch.Tensor, physical: int) -> torch.Tensor:
    """Replicas per logical expert (int64 ``[N]``, summing to ``physical``) for ``loads [steps,
    N]`` (routed tokens per step and expert): step 1 of the module's policy."""
    steps, experts = loads.shape
    if physical < experts:
        raise ValueError(f"{physical} physical slots cannot hold {experts} logical experts")
    loads = loads.double()
    replicas = torch.ones(experts, dtype=torch.float64)
    for _ in range(physical - experts):
        current = loads / replicas
        top2 = current.topk(min(2, experts), dim=1)
        largest, runner_up = top2.values[:, 0:1], top2.values[:, -1:]
        without = torch.where(torch.arange(experts)[None, :] == top2.indices[:, 0:1], runner_up, largest)
        cost = torch.maximum(without, loads / (replicas + 1)).sum(dim=0)
        replicas[int(torch.argmin(cost))] += 1  # argmin takes the first of equal costs: the lower id
    return replicas.long()


def place_replicas(loads: torch.Tensor, replicas: torch.Tensor, ranks: int) -> Placement:
    """Step 2 and 3 of the module's policy: each replica of ``replicas [N]`` on one of ``ranks``
    ranks, each rank taking ``sum(replicas) / ranks`` of them."""
    physical = int(replicas.sum())
    if physical % ranks:
        raise ValueError(f"{physical} physical experts do not split evenly over {ranks} ranks")
    slots = physical // ranks
    loads = loads.double()
    items = [(e, i) for e in range(replicas.numel()) for i in range(int(replicas[e]))]
    per_replica = loads / replicas.double()
    items.sort(key=lambda item: -float(per_replica[:, item[0]].sum()))  # stable: ties keep (expert, replica) order
    rank_load = torch.zeros(ranks, loads.shape[0], dtype=torch.float64)
    held: list[list[int]] = [[] for _ in range(ranks)]
    for expert, _ in items:
        vector = per_replica[:, expert]
        peak = rank_load.max(dim=0).values
        cost = torch.maximum(peak[None, :], rank_load + vector[None, :]).sum(dim=1)
        cost[torch.tensor([len(h) >= slots for h in held])] = float("inf")
        rank = int(torch.argmin(cost))  # the first of equal costs: the lower rank
        rank_load[rank] += vector
        held[rank].append(expert)
    physical_to_logical = torch.tensor([e for h in held for e in h], dtype=torch.int64)
    count = replicas.long().clone()
    logical_to_physical = torch.full((replicas.numel(), int(count.max())), -1, dtype=torch.int64)
    filled = torch.zeros_like(count)
    for slot, expert in enumerate(physical_to_logical.tolist()):
        logical_to_physical[expert, filled[expert]] = slot
        filled[expert] += 1
    return Placement(physical_to_logical, logical_to_physical, count, ranks)


def rebalance(loads: torch.Tensor, extra: int, ranks: int) -> Placement:
    """The EPLB maps for ``loads [steps, N]`` with ``extra`` redundant experts over ``ranks``."""
    return place_replicas(loads, allocate_replicas(loads, loads.shape[1] + extra), ranks)


def static_placement(experts: int, extra: int, ranks: int) -> Placement:
    """The initial maps: physical slots ``[0 .. N-1]`` then replicas of ``i mod N``, in order."""
    physical_to_logical = torch.cat([torch.arange(experts), torch.arange(extra) % experts])
    if physical_to_logical.numel() % ranks:
        raise ValueError(f"{experts} + {extra} physical experts do not split evenly over {ranks} ranks")
    count = torch.bincount(physical_to_logical, minlength=experts)
    logical_to_physical = torch.full((experts, int(count.max())), -1, dtype=torch.int64)
    for expert in range(experts):
        found = torch.nonzero(physical_to_logical == expert).squeeze(1)
        logical_to_physical[expert, :found.numel()] = found
    return Placement(physical_to_logical, logical_to_physical, count, ranks)


def replica_of(expert_ids: torch.Tensor, token_index: torch.Tensor, placement: Placement,
               ep_rank: int = 0) -> torch.Tensor:
    """Physical slots of logical ``expert_ids [T, k]``: the replica ``(ep_rank + token index x
    LARGE_PRIME) mod replicas`` of each token's expert (``token_index [T]``)."""
    count = placement.logical_count[expert_ids]
    replica = (ep_rank + token_index[:, None] * LARGE_PRIME) % count
    return placement.logical_to_physical[expert_ids, replica]


class LoadWindow:
    """The routed-token counts of the last ``window`` steps of one MoE layer: ``[steps, N]``."""

    def __init__(self, experts: int, window: int):
        self.counts = torch.zeros(window, experts, dtype=torch.int64)
        self.steps = 0

    def record(self, counts: torch.Tensor) -> None:
        """Add one step's tokens per logical expert (the oldest step leaves a full window)."""
        self.counts[self.steps % self.counts.shape[0]] = counts.to(self.counts)
        self.steps += 1

    def loads(self) -> torch.Tensor:
        """The window's steps so far (oldest first), ``[min(steps, window), N]``."""
        window = self.counts.shape[0]
        if self.steps <= window:
            return self.counts[:self.steps].clone()
        start = self.steps % window
        return torch.cat([self.counts[start:], self.counts[:start]])
