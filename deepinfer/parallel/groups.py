"""The process groups of a parallel plan, joined from torchrun's environment.

A plan of more than one rank needs exactly that many processes, started by torchrun (or any
launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``). The collective
backend follows the device: gloo on the CPU, NCCL on CUDA, HCCL on an NPU. Every collective runs
under the plan's ``parallel.timeout_s``, so a rank that dies or stalls ends the run with an error
instead of a hang."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""Collective backend by device type."""


@dataclass(frozen=True)
class ProcessGroups:
    """This process's place in the plan: its ``rank`` of ``world``, the group the routed experts
    are spread over (``expert``: every rank under expert parallelism, else None), the group
    the requests are spread over (``data``: every rank under attention data parallelism, else
    None) and the group a prefill step's rows are spread over (``context``: every rank under
    context parallelism, else None)."""

    rank: int
    world: int
    expert: object = None
    data: object = None
    context: object = None

    @property
    def shared_schedule(self) -> bool:
        """Whether every rank runs every request, in the same steps (no attention DP)."""
        return self.data is None


def plan_world(plan) -> int:
    """Processes a plan (:class:`~deepinfer.config.schema.ParallelConfig`) runs on."""
    if plan.world_size is not None:
        return plan.world_size
    return plan_ranks(plan)


def plan_ranks(plan) -> int:
    """The largest dimension of a plan: more than one where it names process groups."""
    return max(plan.data_parallel, plan.expert_parallel, plan.context_parallel)


def check_plan(parallel, decoding) -> None:
    """Refuse the plans (:class:`~deepinfer.config.schema.ParallelConfig`, with the run's
    ``decoding``) that are not implemented yet, naming the ones that are."""
    if parallel.context_parallel > 1 and max(parallel.data_parallel, parallel.expert_parallel) > 1:
        raise ValueError(f"context parallelism together with attention DP or expert parallelism is not implemented "
                         f"yet (parallel.context_parallel={parallel.context_parallel}, data_parallel="
                         f"{parallel.data_parallel}, expert_parallel={parallel.expert_parallel}); use a context-"
                         f"parallel plan alone (cp2, cp4) or the DP and EP plans without it")
    shared_schedule = parallel.data_parallel == 1 and plan_ranks(parallel) > 1
    if shared_schedule and decoding.num_draft_tokens and decoding.varlen:
        raise ValueError(f"parallel={parallel.name} runs every request on every rank in the same steps, and DSpark's "
                         f"confidence-scheduled verify lengths (decoding.varlen=true) follow each rank's own step "
                         f"timings; set decoding.varlen=false (fixed verify lengths) under this plan")
    if parallel.data_parallel > 1 and parallel.expert_parallel > 1:
        if parallel.data_parallel != parallel.expert_parallel:
            raise ValueError(f"attention DP with expert parallelism runs both over the same ranks: "
                             f"parallel.data_parallel ({parallel.data_parallel}) must equal parallel.expert_parallel "
                             f"({parallel.expert_parallel})")


def join(plan, device: torch.device) -> ProcessGroups | None:
    """Join (or reuse) the default process group for ``plan``; None for a plan that names no group.
    Refuses a launch whose ``WORLD_SIZE`` is not the plan's, naming the torchrun command that fits.
    With ``parallel.world_size=1`` the plan's groups are joined on one process."""
    world = plan_world(plan)
    if plan_ranks(plan) == 1:
        return None
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:
        raise RuntimeError(f"parallel={plan.name} runs on {world} processes, but this one was started among "
                           f"{launched} (WORLD_SIZE); launch it with torchrun --nproc-per-node {world} ...")
    backend = BACKENDS.get(device.type)
    if backend is None:
        raise RuntimeError(f"no collective backend is known for device type {device.type!r} "
                           f"(known: {', '.join(BACKENDS)})")
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
        elif device.type == "npu":  # torch.npu exists once torch_npu is imported (the backend's native path)
            torch.npu.set_device(local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=plan.timeout_s))
    elif dist.get_world_size() != world:
        raise RuntimeError(f"the process group already joined has {dist.get_world_size()} ranks; "
                           f"parallel={plan.name} needs {world}")
    every = dist.group.WORLD
    return ProcessGroups(dist.get_rank(), world, expert=every if plan.expert_parallel > 1 else None,
                         data=every if plan.data_parallel > 1 else None,
                         context=every if plan.context_parallel > 1 else None)


def leave(groups: ProcessGroups | None) -> None:
    """Leave the plan's process group once every rank is done with it: a barrier first, so that no
    rank closes its connections while a peer still reads the last collective's data. The caller
    then drops the engine (and runs the garbage collector) before the interpreter exits: the
    group's last references go while Python can still release what its threads hold."""
    if groups is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_TRANSPORT_WORDS = ("gloo", "nccl", "hccl", "connection closed", "connection reset", "timed out", "timeout")


def lost_peer(error: BaseException, groups: ProcessGroups | None, plan) -> RuntimeError | None:
    """An error naming this rank and the plan for ``error`` where it came from the collectives'
    transport (another rank ended, or stalled past ``parallel.timeout_s``); None for any other error."""
    if groups is None or not isinstance(error, RuntimeError):
        return None
    text = str(error).lower()
    if not (isinstance(error, getattr(dist, "DistError", ())) or any(word in text for word in _TRANSPORT_WORDS)):
        return None
    return RuntimeError(f"parallel={plan.name}: rank {groups.rank} of {groups.world} lost its peers in a collective: "
                        f"another rank ended (see its own error, and torchrun's summary of the ranks' exit codes) "
                        f"or waited past parallel.timeout_s={plan.timeout_s} s. The transport said: {error}")
