"""Expert parallelism: each rank holds an equal share of every MoE's physical experts (the routed
experts, plus ``parallel.num_extra_experts`` redundant replicas of them under EPLB), and the MoE's
dispatch and combine move the tokens' rows to their experts' holders and back (``ep_dispatch`` /
``ep_combine`` over the expert group). The shared expert, the gate and everything outside the
routed experts stay whole on every rank.

Without redundant experts rank ``r`` holds a contiguous ``1/world`` of the experts. With them a
layer's :class:`ExpertMap` routes each token's logical experts to physical replicas
(:func:`~deepinfer.parallel.eplb.replica_of`), counts the routed tokens per logical expert over a
window of steps, and every ``parallel.eplb_interval`` steps re-places the replicas by EPLB's policy,
moving the weights between ranks by point-to-point sends (a rank's own copies stay put)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.parallel.eplb import LoadWindow, Placement, rebalance, replica_of, static_placement


def local_experts(num_experts: int, world: int, rank: int) -> range:
    """The global ids of the experts ``rank`` of ``world`` owns: a contiguous ``1/world`` share."""
    if num_experts % world:
        raise ValueError(f"{num_experts} routed experts do not divide over {world} expert-parallel ranks; pick an "
                         f"expert_parallel that divides every MoE's expert count (the draft layers' too)")
    share = num_experts // world
    return range(rank * share, (rank + 1) * share)


class ExpertMap:
    """One MoE layer's EPLB state on this rank: the placement, the load window and the physical
    experts' weights it holds (in ``moe.experts``)."""

    def __init__(self, moe, extra: int, window: int, group):
        self.moe, self.extra, self.group = moe, extra, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.placement = static_placement(moe.num_experts, extra, self.world)
        self.window = LoadWindow(moe.num_experts, window)
        self.pending: torch.Tensor | None = None  # this step's counts, on the tokens' device
        self._device_placement: Placement | None = None  # the placement's maps on the tokens' device

    @property
    def num_physical(self) -> int:
        return self.placement.physical_to_logical.numel()

    def slots(self, placement: Placement | None = None) -> torch.Tensor:
        """The logical experts of this rank's physical slots."""
        held = (placement or self.placement).physical_to_logical
        share = held.numel() // self.world
        return held[self.rank * share:(self.rank + 1) * share]

    def route(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical slots of the logical ``ids [T, k]`` (-1 stays unrouted); the tokens are counted."""
        routed = ids >= 0
        counts = torch.bincount(ids[routed], minlength=self.moe.num_experts)
        self.pending = counts if self.pending is None else self.pending + counts
        token = torch.arange(ids.shape[0], device=ids.device)
        placement = self._on(ids.device)
        return torch.where(routed, replica_of(ids.clamp(min=0), token, placement, self.rank), -1)

    def end_step(self) -> None:
        """Close a step's counts into the window (zeros for a step that routed nothing here, so
        that every rank's window holds the same steps)."""
        counts = self.pending.cpu() if self.pending is not None else torch.zeros_like(self.window.counts[0])
        self.window.record(counts)
        self.pending = None

    def rebalance(self) -> None:
        """Re-place the replicas from the window's loads, summed over the ranks, and move the weights
        to their new slots. Every rank calls it at the same step."""
        loads = self.window.loads()
        if not loads.shape[0]:
            return
        device = self.moe.experts.w1.device if dist.get_backend(self.group) != "gloo" else torch.device("cpu")
        loads = loads.to(device)
        dist.all_reduce(loads, group=self.group)  # every rank's tokens: the same placement everywhere
        new = rebalance(loads.cpu(), self.extra, self.world)
        self._move(new)
        self.placement = new
        self._device_placement = None

    def _on(self, device: torch.device) -> Placement:
        cached = self._device_placement
        if cached is None or cached.logical_count.device != device:
            p = self.placement
            cached = Placement(p.physical_to_logical.to(device), p.logical_to_physical.to(device),
                               p.logical_count.to(device), p.ranks)
            self._device_placement = cached
        return cached

    def _move(self, new: Placement) -> None:
        """Every rank's new slots filled from a holder of the same logical expert under the current
        placement (itself where it holds one; else the lowest rank that does), one send a slot."""
        old = self.placement.physical_to_logical
        share = old.numel() // self.world
        holders = {}
        for slot, expert in enumerate(old.tolist()):
            holders.setdefault(expert, []).append(slot)
        experts = self.moe.experts
        names = [n for n in [*experts.PROJECTIONS, *(f"{p}_scale" for p in experts.PROJECTIONS)]
                 if getattr(experts, n) is not None]
        current = {n: getattr(experts, n).data for n in names}
        fresh = {n: torch.empty_like(t) for n, t in current.items()}
        ops = []
        for dst in range(self.world):
            for j, expert in enumerate(new.physical_to_logical[dst * share:(dst + 1) * share].tolist()):
                own = [s for s in holders[expert] if s // share == dst]
                src_slot = own[0] if own else holders[expert][0]
                src = src_slot // share
                tag = dst * share + j
                if src == dst == self.rank:
                    for n in names:
                        fresh[n][j].copy_(current[n][src_slot - src * share])
                elif src == self.rank:
                    ops += [dist.P2POp(dist.isend, current[n][src_slot - src * share].contiguous(), dst, self.group,
                                       tag * len(names) + i) for i, n in enumerate(names)]
                elif dst == self.rank:
                    ops += [dist.P2POp(dist.irecv, fresh[n][j], src, self.group, tag * len(names) + i)
                            for i, n in enumerate(names)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for n in names:
            setattr(experts, n, nn.Parameter(fresh[n], requires_grad=False))


class ExpertBalancing:
    """EPLB's cadence over every layer's :class:`ExpertMap`: each engine step closes the layers'
    counts, and every ``interval`` steps (0: never) the experts are re-placed."""

    def __init__(self, maps: list[ExpertMap], interval: int):
        self.maps, self.interval, self.steps = maps, interval, 0

    def advance(self) -> bool:
        """Close a step's routed-token counts; True when the experts are to be re-placed now."""
        for expert_map in self.maps:
            expert_map.end_step()
        self.steps += 1
        return bool(self.maps and self.interval) and self.steps % self.interval == 0

    def rebalance(self) -> None:
        """Re-place every layer's experts (every rank at the same step)."""
        for expert_map in self.maps:
            expert_map.rebalance()


def shard_experts(model: nn.Module, group, extra: int = 0, window: int = 100) -> list[ExpertMap]:
    """Keep this rank's share of every MoE's experts in ``model`` (backbone and draft layers) and
    route its dispatch and combine through ``group``: with ``extra`` redundant experts, each layer
    gets an :class:`ExpertMap` (returned) over ``window`` steps of loads, its physical slots
    placed statically first; else a contiguous share (:func:`local_experts`). The full model was
    built and loaded first; the experts this rank does not hold are freed here."""
    from deepinfer.models.deepseek_v41.moe import MoE

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    maps = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if extra:
            expert_map = ExpertMap(moe, extra, window, group)
            held = expert_map.slots()
            moe.eplb = expert_map
            maps.append(expert_map)
        else:
            owned = local_experts(moe.num_experts, world, rank)
            held = torch.arange(owned.start, owned.stop)
        experts = moe.experts
        for name in [*experts.PROJECTIONS, *(f"{p}_scale" for p in experts.PROJECTIONS)]:
            value = getattr(experts, name)
            if value is not None:
                setattr(experts, name, nn.Parameter(value.data[held.to(value.device)].clone(), requires_grad=False))
        moe.ep_group = group
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return maps
