"""The sm100 bf16 grouped GEMM on a GPU (skipped without one, or without tilelang): the kernel the
wrapper picks for the shape, on segments that are empty, shorter than a warpgroup's 64 rows or
end just past a tile, with ``n`` and ``k`` that leave partial tiles, against a float64 result."""
import importlib.util

import pytest
import torch

from deepinfer.hal import get_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                                  reason="the sm100 backend needs tilelang")]
SEGMENTS = {
    "128_row_tiles": [0, 1, 63, 64, 65, 128, 129, 300, 0],  # 750 rows over 9 experts
    "64_row_tiles": [0, 1, 5, 63, 0, 2],  # 71 rows: short segments take 64-row tiles
}


@pytest.mark.parametrize("n,k", [(512, 320), (40, 64)])
@pytest.mark.parametrize("segments", sorted(SEGMENTS))
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_grouped_gemm_matches_float64_on_ragged_segments(segments, n, k, batch_invariant):
    from deepinfer_backends.sm100 import gemm, toolchain

    sizes = torch.tensor(SEGMENTS[segments])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(sizes.sum()), k, generator=g).bfloat16()
    w = (torch.randn(len(sizes), n, k, generator=g) * k ** -0.5).bfloat16()
    module, _, tiles = gemm.bf16_kernel(x.shape[0], len(sizes), n, k, toolchain.device_arch(), batch_invariant)
    assert tiles["block_m"] == (64 if batch_invariant or segments == "64_row_tiles" else 128)
    if toolchain.device_arch() == toolchain.HOPPER:
        assert module == ("grouped_gemm" if batch_invariant else "grouped_gemm_ws")
    y = get_backend("sm100").implementations(batch_invariant=batch_invariant)["grouped_gemm"](
        x.cuda(), w.cuda(), sizes.cuda())
    expected, start = torch.empty(x.shape[0], n, dtype=torch.float64), 0
    for expert, size in enumerate(sizes.tolist()):
        expected[start:start + size] = x[start:start + size].double() @ w[expert].double().T
        start += size
    assert y.dtype == torch.bfloat16 and y.shape == expected.shape
    torch.testing.assert_close(y.cpu().double(), expected, rtol=2 ** -7, atol=1e-3)
