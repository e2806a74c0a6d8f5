"""The CUDA runtime's pinned staging ring: every upload arrives intact, also when a larger array
resizes the ring while earlier copies are still queued, and the ring resizes all its buffers at
once (one allocation round per size, not one per buffer and step)."""
import numpy as np
import pytest
import torch

from deepinfer.engine.device import PINNED_SLOTS, CudaRuntime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging ring needs a CUDA device")


def test_uploads_arrive_intact_across_resizes_of_the_ring():
    runtime = CudaRuntime(torch.device("cuda"))
    rng = np.random.default_rng(0)
    sizes = [10, 5000, 3, 0, 70000, 7, 4096, 130000] * 3
    arrays = [rng.integers(-2 ** 62, 2 ** 62, size=n, dtype=np.int64) for n in sizes]
    moved = [runtime.upload(array) for array in arrays]  # nothing waits in between
    for array, tensor in zip(arrays, moved):
        assert tensor.dtype == torch.int64 and tensor.device.type == "cuda"
        assert np.array_equal(tensor.cpu().numpy(), array)


def test_one_large_upload_sizes_every_buffer_of_the_ring():
    runtime = CudaRuntime(torch.device("cuda"))
    runtime.upload(np.arange(5, dtype=np.int64))
    runtime.upload(np.arange(70000, dtype=np.int64))
    capacities = {buffer.numel() for buffer in runtime._pinned}
    assert len(runtime._pinned) == PINNED_SLOTS and capacities == {1 << 17}
    pinned = [buffer.data_ptr() for buffer in runtime._pinned]
    for n in (3, 70000, 131072, 9):  # fits: the same buffers, in turn
        out = torch.empty(n, dtype=torch.int64, device="cuda")
        runtime.upload(np.full(n, 7, dtype=np.int64), out=out)
        assert bool((out == 7).all())
    assert [buffer.data_ptr() for buffer in runtime._pinned] == pinned
