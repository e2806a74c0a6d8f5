"""Decode-shaped passes over padded, fixed device buffers, replayed from CUDA graphs.

A pass takes a few int64 inputs per sequence (token ids, start position, state slot, block
table, ...). The batch is padded to the next captured size with placeholder rows (all zeros:
position 0, state slot 0, block 0, which the KV manager never hands out), every input of the
step goes up in one transfer into the pass's own buffer, and the outputs land in buffers the
graph writes. Run eagerly, the same padded shapes and kernels run without a graph, so graphed
and eager steps compute the same values."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from deepinfer.engine.device import Runtime
from deepinfer.hal.value_checks import skip_value_checks

Inputs = dict[str, torch.Tensor]
Outputs = dict[str, torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then steps of 16, the last one ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def graph_table_widths(table_width: int) -> list[int]:
    """Block-table widths the padded passes are built for: 16, 64, 256, 1024 blocks (those
    below ``table_width``), then ``table_width``. A step takes the narrowest that holds its
    longest sequence, so the work that scales with the table (the decode indexer scores every
    key slot it covers) follows the batch's context, not ``max_model_len``."""
    return [w for w in (16, 64, 256, 1024) if w < table_width] + [table_width]


class PaddedPass:
    """``fn(inputs) -> outputs`` over batches padded to one of ``sizes``.

    ``fields`` name the int64 inputs and their width per sequence; ``fn`` gets them as
    ``[size, width]`` views and returns tensors whose first dimension is a multiple of the
    size. Float inputs travel as the int64 bits of float64 values (:func:`float_bits`)."""

    def __init__(self, name: str, fn: Callable[[Inputs], Outputs], fields: dict[str, int], sizes: list[int],
                 runtime: Runtime):
        self.name, self.fn, self.fields, self.sizes, self.runtime = name, fn, dict(fields), sorted(sizes), runtime
        self.buffer = torch.zeros(max(sizes) * sum(fields.values()), dtype=torch.int64, device=runtime.device)
        self.outputs: Outputs | None = None
        self.graphs: dict[int, Callable[[], None]] = {}

    def size_for(self, count: int) -> int | None:
        """The padded size a batch of ``count`` sequences runs at (None: too many)."""
        return next((s for s in self.sizes if s >= count), None)

    def __call__(self, count: int, arrays: dict[str, np.ndarray]) -> Outputs:
        """Run ``count`` sequences (``arrays[name]``: ``[count, width]``); outputs cover their rows."""
        size = self.size_for(count)
        if size is None:
            raise ValueError(f"{self.name} pass: {count} sequences exceed the largest padded size {self.sizes[-1]}")
        packed = np.zeros(size * sum(self.fields.values()), dtype=np.int64)
        offset = 0
        for name, width in self.fields.items():
            packed[offset:offset + count * width] = np.asarray(arrays[name], dtype=np.int64).reshape(-1)
            offset += size * width
        self.runtime.upload(packed, out=self.buffer[:packed.size])
        if size in self.graphs:
            self.graphs[size]()
            outputs, rows_of = self.outputs, self.sizes[-1]
        else:
            with skip_value_checks(), torch.no_grad():
                outputs, rows_of = self.fn(self._views(size)), size
        return {name: out[:count * (out.shape[0] // rows_of)] for name, out in outputs.items()}

    def capture(self, progress: Callable[[], None] = lambda: None) -> None:
        """Warm up every size eagerly, then record one graph per size, largest first."""
        largest = self.sizes[-1]
        with skip_value_checks(), torch.no_grad():
            self.outputs = {name: torch.empty_like(out) for name, out in self.fn(self._views(largest)).items()}
            for size in reversed(self.sizes):
                self._write_outputs(size)
                self.runtime.synchronize()
                self.graphs[size] = self.runtime.capture(lambda size=size: self._write_outputs(size))
                progress()

    def _write_outputs(self, size: int) -> None:
        for name, out in self.fn(self._views(size)).items():
            self.outputs[name][:out.shape[0]].copy_(out)

    def _views(self, size: int) -> Inputs:
        views, offset = {}, 0
        for name, width in self.fields.items():
            views[name] = self.buffer[offset:offset + size * width].view(size, width)
            offset += size * width
        return views


def float_bits(values) -> np.ndarray:
    """float64 ``values`` as int64 bit patterns, for a :class:`PaddedPass` input."""
    return np.asarray(values, dtype=np.float64).view(np.int64)


def as_float(bits: torch.Tensor) -> torch.Tensor:
    """The float32 values of int64 bit patterns written by :func:`float_bits`."""
    return bits.contiguous().view(torch.float64).float()
