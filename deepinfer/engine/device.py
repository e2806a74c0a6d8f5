"""The engine's view of its device: host staging, graph capture and memory.

This is the one place the engine touches ``torch.cuda``. :class:`Runtime` serves devices whose
tensors the host reads directly (the CPU); :class:`CudaRuntime` stages host arrays through a
ring of pinned buffers (one non-blocking copy each), captures CUDA graphs into one shared
memory pool, and reports device memory for KV sizing."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

PINNED_SLOTS = 4
"""Pinned staging buffers used in turn; a buffer is refilled only after its copy has finished."""


class Runtime:
    """A device without graphs or pinned staging (the CPU)."""

    supports_graphs = False

    def __init__(self, device: torch.device):
        self.device = device

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """The int64 ``array`` on the device as one transfer, into ``out`` when given."""
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        if out is None:
            return host.to(self.device)
        return out.copy_(host)

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, complete on return (the step's one synchronisation)."""
        return tensor.to("cpu", copy=True)

    def capture(self, work: Callable[[], None]) -> Callable[[], None]:
        """Record ``work`` once and return what replays it."""
        raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}; set engine.cuda_graphs=false")

    def memory(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of device memory, or None where the engine does not size from it."""
        return None

    def allocated(self) -> int:
        return 0

    def peak_allocated(self) -> int:
        """Peak bytes allocated since :meth:`reset_peak`."""
        return 0

    def reset_peak(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CudaRuntime(Runtime):
    """A CUDA device: pinned staging, graphs in one shared pool, memory statistics."""

    supports_graphs = True

    def __init__(self, device: torch.device):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        torch.cuda.set_device(device)
        self._pinned: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = []
        self._next = 0
        self._pool = None

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        slot = self._next
        self._next = (slot + 1) % PINNED_SLOTS
        if len(self._pinned) <= slot:
            self._pinned.append(torch.empty(0, dtype=torch.int64).pin_memory())
            self._copied.append(None)
        if self._copied[slot] is not None and not self._copied[slot].query():
            self._copied[slot].synchronize()
        if self._pinned[slot].numel() < array.size:
            self._pinned[slot] = torch.empty(max(array.size, 2 * self._pinned[slot].numel()),
                                             dtype=torch.int64).pin_memory()
        staging = self._pinned[slot][:array.size]
        staging.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)))
        moved = staging.to(self.device, non_blocking=True) if out is None else out.copy_(staging, non_blocking=True)
        self._copied[slot] = torch.cuda.Event()
        self._copied[slot].record()
        return moved

    def capture(self, work: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            work()
        if self._pool is None:
            self._pool = graph.pool()
        return graph.replay

    def memory(self) -> tuple[int, int]:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def make_runtime(device: torch.device) -> Runtime:
    """The runtime of ``device`` (by its type: CUDA, else the plain host-readable one)."""
    return CudaRuntime(device) if device.type == "cuda" else Runtime(device)
