"""The on-chip buffers a kernel's tile plan allocates, and the check that they fit an AI core.

A plan lists its buffers (scope, bytes, how many copies for double buffering); laid out in
order, each at an offset aligned for its scope (32 B; 512 B for the cube's L0A and L0B), they
must fit the platform's capacity per AI core. tilelang-ascend does not check this when it
lowers a kernel, so every plan is checked here before it runs or is emitted."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

KIB = 1024
CAPACITY = {
    "A5": {"UB": 256 * KIB, "L1": 512 * KIB, "L0A": 64 * KIB, "L0B": 64 * KIB, "L0C": 256 * KIB},
    "A3": {"UB": 192 * KIB, "L1": 512 * KIB, "L0A": 64 * KIB, "L0B": 64 * KIB, "L0C": 128 * KIB},
    "A2": {"UB": 192 * KIB, "L1": 512 * KIB, "L0A": 64 * KIB, "L0B": 64 * KIB, "L0C": 128 * KIB},
}
"""Bytes per AI core by platform and scope."""
ALIGNMENT = {"UB": 32, "L1": 32, "L0A": 512, "L0B": 512, "L0C": 32}
AI_CORES = {"A5": 32, "A3": 24, "A2": 24}
"""AI cores (one cube and two vector cores each) the plans spread their blocks over."""


class TileBudgetError(ValueError):
    """A tile plan's buffers do not fit an AI core's capacity."""


@dataclass(frozen=True)
class Buffer:
    """``copies`` x ``bytes`` in ``scope`` (UB, L1, L0A, L0B, L0C)."""

    name: str
    scope: str
    bytes: int
    copies: int = 1


def layout(buffers: tuple[Buffer, ...], platform: str = "A5") -> dict[str, int]:
    """Each buffer's offset in its scope, laid out in order with the scope's alignment; raises
    :class:`TileBudgetError` naming the scope, the bytes needed and the capacity when they overflow."""
    if platform not in CAPACITY:
        raise ValueError(f"unknown platform {platform!r}; known: {sorted(CAPACITY)}")
    offsets, ends = {}, {}
    for buffer in buffers:
        if buffer.scope not in ALIGNMENT:
            raise ValueError(f"buffer {buffer.name!r}: unknown scope {buffer.scope!r}; scopes: {sorted(ALIGNMENT)}")
        align = ALIGNMENT[buffer.scope]
        start = -(-ends.get(buffer.scope, 0) // align) * align
        offsets[buffer.name] = start
        ends[buffer.scope] = start + buffer.bytes * buffer.copies
    for scope, end in ends.items():
        if end > CAPACITY[platform][scope]:
            names = [b.name for b in buffers if b.scope == scope]
            raise TileBudgetError(f"{scope} holds {CAPACITY[platform][scope] // KIB} KiB per AI core on {platform}, "
                                  f"but {names} need {end / KIB:g} KiB (aligned to {ALIGNMENT[scope]} B); "
                                  f"use smaller tiles or fewer copies")
    return offsets


def rows_that_fit(plan: Callable[[int], tuple[Buffer, ...]], budget: int, platform: str = "A5") -> int:
    """The most rows ``r`` (up to 4096) whose ``plan(r)``, laid out, ends within ``budget`` bytes in
    every scope; 1 when even one row does not (its layout is still checked against the capacity)."""
    def fits(rows: int) -> bool:
        buffers = plan(rows)
        try:
            offsets = layout(buffers, platform)
        except TileBudgetError:
            return False
        return all(offsets[b.name] + b.bytes * b.copies <= budget for b in buffers)

    low, high = 1, 4096
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    layout(plan(low), platform)
    return low
