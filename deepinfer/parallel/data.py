"""Attention data parallelism: each rank is an engine of its own (scheduler, caches, the whole
model) and takes every ``world``-th request of a ``generate`` call; the outputs come back to every
rank in the prompts' order. With the experts replicated, the ranks' forwards share nothing, so
they run their steps independently."""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def my_share(items: Sequence[T], rank: int, world: int) -> list[T]:
    """The items ``rank`` of ``world`` takes: ``rank``, ``rank + world``, ..."""
    return list(items[rank::world])


def gather_in_order(mine: list[T], count: int, rank: int, world: int, group) -> list[T]:
    """Every rank's :func:`my_share` results of ``count`` items, back in the items' order, on every rank."""
    parts: list = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    out: list = [None] * count
    for r, part in enumerate(parts):
        if len(part) != len(range(r, count, world)):
            raise RuntimeError(f"rank {r} returned {len(part)} outputs for its {len(range(r, count, world))} requests")
        out[r::world] = part
    return out
