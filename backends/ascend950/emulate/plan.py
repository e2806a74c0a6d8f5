"""Spreading a kernel's output tiles over the AI cores, and the record of what each core wrote."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class BlockPlan:
    """Output tiles handed to ``cores`` AI cores round-robin, in the order the kernel enumerates
    them; ``writes`` counts, per output element, the tiles that stored it (each exactly once)."""

    cores: int
    tiles: list[tuple] = field(default_factory=list)

    def add(self, tile: tuple) -> None:
        self.tiles.append(tile)

    def per_core(self) -> list[list[tuple]]:
        """Each core's tiles, in the order it runs them."""
        return [self.tiles[core::self.cores] for core in range(self.cores)]


class WriteRecord:
    """Counts the stores into each element of an ``[rows, cols]`` output."""

    def __init__(self, rows: int, cols: int):
        self.count = torch.zeros(rows, cols, dtype=torch.int32)

    def store(self, rows: slice, cols: slice) -> None:
        self.count[rows, cols] += 1

    def check(self, rows_written: int) -> None:
        """Every element of the first ``rows_written`` rows stored exactly once, none after."""
        written, rest = self.count[:rows_written], self.count[rows_written:]
        if written.numel() and (written.min() != 1 or written.max() != 1):
            raise AssertionError(f"output tiles overlap or leave gaps: element stores range "
                                 f"{int(written.min())}..{int(written.max())} (want exactly 1)")
        if rest.numel() and rest.any():
            raise AssertionError("a tile stored rows past the last expert segment")


def run_row_tiles(rows: int, tile: int, cores: int, body: Callable[[int, int], None]) -> None:
    """``body(first, end)`` for each tile of ``tile`` rows of a ``rows``-row output, the tiles
    handed to ``cores`` vector cores round-robin and run core by core; then checks every row was
    stored exactly once."""
    record = WriteRecord(rows, 1)
    plan = BlockPlan(cores)
    for first in range(0, rows, tile):
        plan.add((first, min(first + tile, rows)))
    for core_tiles in plan.per_core():
        for first, end in core_tiles:
            body(first, end)
            record.store(slice(first, end), slice(0, 1))
    record.check(rows)
