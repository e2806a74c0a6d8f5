"""The engine's view of its device: queued step work, host staging, graph capture and memory.

This is the one place the engine touches ``torch.cuda``. :class:`Runtime` serves devices whose
tensors the host reads directly (the CPU); :class:`CudaRuntime` stages host arrays through a
ring of pinned buffers (one non-blocking copy each), copies results down without waiting,
captures CUDA graphs into one shared memory pool, and reports device memory for KV sizing;
:class:`ThreadedCpuRuntime` runs a CPU's step work on a worker thread, so the engine's
asynchronous schedule overlaps there too."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Callable, TypeVar

import numpy as np
import torch

T = TypeVar("T")
PINNED_SLOTS = 8
"""Pinned staging buffers used in turn; a buffer is refilled only after its copy has finished."""
MIN_STAGING = 4096
"""Smallest capacity (int64 elements) of a staging buffer."""


class Runtime:
    """A device without graphs or pinned staging (the CPU). ``overlaps_host``: device work
    runs while the host goes on (what asynchronous scheduling needs to pay off)."""

    supports_graphs = False
    overlaps_host = False

    def __init__(self, device: torch.device):
        self.device = device

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """The int64 ``array`` on the device as one transfer, into ``out`` when given."""
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        if out is None:
            return host.to(self.device)
        return out.copy_(host)

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, complete on return (a synchronisation)."""
        return self.start_download(tensor)()

    def start_download(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying ``tensor`` to the host after the work queued so far; the returned
        call waits for the copy and returns it."""
        host = tensor.to("cpu", copy=True)
        return lambda: host

    def run_async(self, work: Callable[[], T]) -> Callable[[], T]:
        """Queue ``work`` (a step's device work) after everything queued before; the returned
        call waits for it and gives its result. Here, and on CUDA (whose kernels queue on
        their own), ``work`` runs at once."""
        result = work()
        return lambda: result

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


class ThreadedCpuRuntime(Runtime):
    """The CPU with its device work on one worker thread, in queue order, as a CUDA stream
    runs kernels: the host schedules and post-processes while a step computes, so asynchronous
    scheduling really overlaps on a CPU (its tests use it). ``delay_s`` makes each piece of
    queued work that much slower."""

    overlaps_host = True

    def __init__(self, device: torch.device, delay_s: float = 0.0):
        super().__init__(device)
        self.delay_s = delay_s
        self._queue: SimpleQueue = SimpleQueue()
        threading.Thread(target=self._work, name="deepinfer-device", daemon=True).start()

    def _work(self) -> None:
        while True:
            work, done = self._queue.get()
            try:
                if self.delay_s:
                    threading.Event().wait(self.delay_s)
                done.set_result(work())
            except BaseException as error:  # handed to the host at its wait
                done.set_exception(error)

    def run_async(self, work: Callable[[], T]) -> Callable[[], T]:
        done: Future = Future()
        self._queue.put((work, done))
        return done.result

    def synchronize(self) -> None:
        self.run_async(lambda: None)()


class CudaRuntime(Runtime):
    """A CUDA device: pinned staging, graphs in one shared pool, memory statistics."""

    supports_graphs = True
    overlaps_host = True

    def __init__(self, device: torch.device):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        torch.cuda.set_device(device)
        self._pinned: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None] * PINNED_SLOTS
        self._next = 0
        self._pool = None

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """The int64 ``array`` on the device, staged through the next pinned buffer of the ring
        (waiting only if that buffer's last copy is still running). An array larger than the
        buffers resizes every buffer of the ring at once, to a power of two, so that the ring
        takes the largest step's size in one go rather than one buffer per step."""
        slot = self._next
        self._next = (slot + 1) % PINNED_SLOTS
        if self._copied[slot] is not None and not self._copied[slot].query():
            self._copied[slot].synchronize()
        if not self._pinned or self._pinned[0].numel() < array.size:
            capacity = max(MIN_STAGING, 1 << (int(array.size) - 1).bit_length())
            # a buffer whose copy is still queued stays allocated until the copy is done (the
            # caching host allocator records the copy's stream), so the old buffers may go
            self._pinned = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(PINNED_SLOTS)]
        staging = self._pinned[slot][:array.size]
        staging.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)))
        moved = staging.to(self.device, non_blocking=True) if out is None else out.copy_(staging, non_blocking=True)
        self._copied[slot] = torch.cuda.Event()
        self._copied[slot].record()
        return moved

    def start_download(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def wait() -> torch.Tensor:
            copied.synchronize()
            return host
        return wait

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
