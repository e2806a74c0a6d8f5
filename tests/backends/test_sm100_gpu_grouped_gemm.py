"""The sm100 grouped GEMM on a GPU (skipped without one, or without tilelang), bf16 and
block-scaled: the kernel the wrapper picks for the shape, on segments that are empty, shorter
than a warpgroup's 64 rows or end just past a tile, with ``n`` and ``k`` that leave partial tiles,
against a float64 result."""
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


QUANT_PAIRS = [("fp8", "fp8"), ("fp8", "mxfp4"), ("bf16", "fp8"), ("bf16", "mxfp4")]


def _block_scaled(g, shape, fmt):
    """Random valid bytes of ``fmt`` (no e4m3 NaN codes) with UE8M0 scales over 2^-127 .. 2^13: a
    subnormal scale and both sides of the decode's one-multiply bound (bytes 128 / 134)."""
    from deepinfer.hal.formats import Quantized

    if fmt == "bf16":
        return torch.randn(*shape, generator=g).bfloat16()
    *lead, k = shape
    data = torch.randint(0, 256, (*lead, k // 2 if fmt == "mxfp4" else k), generator=g, dtype=torch.uint8)
    if fmt == "fp8":
        data[(data & 0x7F) == 0x7F] -= 1
        data = data.view(torch.float8_e4m3fn)
    return Quantized(data, torch.randint(0, 141, (*lead, k // 32), generator=g, dtype=torch.uint8), fmt, 32)


@pytest.mark.parametrize("n,k", [(512, 1024), (40, 1024), (512, 384)])
@pytest.mark.parametrize("segments", sorted(SEGMENTS))
@pytest.mark.parametrize("x_format,w_format", QUANT_PAIRS)
def test_block_scaled_grouped_gemm_matches_float64_on_ragged_segments(x_format, w_format, segments, n, k):
    """The kernel the wrapper picks (warp-specialised for K a multiple of 512 on Hopper, the
    portable one for K = 384; N = 40 leaves most of a column tile empty) against float64 sums of
    the exactly decoded operands."""
    from deepinfer.hal.formats import Quantized
    from deepinfer_backends.sm100 import gemm, toolchain

    sizes = torch.tensor(SEGMENTS[segments])
    g = torch.Generator().manual_seed(2)
    x, w = _block_scaled(g, (int(sizes.sum()), k), x_format), _block_scaled(g, (len(sizes), n, k), w_format)
    module, _, tiles = gemm.quant_kernel(int(sizes.sum()), len(sizes), n, k, toolchain.device_arch())
    assert tiles["block_m"] == (64 if segments == "64_row_tiles" else 128)
    if toolchain.device_arch() == toolchain.HOPPER:
        assert module == ("grouped_gemm_quant_ws" if k % 512 == 0 else "grouped_gemm_quant")
    on_gpu = [Quantized(t.data.cuda(), t.scale.cuda(), t.fmt, t.block) if isinstance(t, Quantized) else t.cuda()
              for t in (x, w)]
    y = get_backend("sm100").implementations()["grouped_gemm"](*on_gpu, sizes.cuda())
    xs, ws = (t.dequantize().double() if isinstance(t, Quantized) else t.double() for t in (x, w))
    expected, start = torch.empty(xs.shape[0], n, dtype=torch.float64), 0
    for expert, size in enumerate(sizes.tolist()):
        expected[start:start + size] = xs[start:start + size] @ ws[expert].T
        start += size
    assert y.dtype == torch.float32 and y.shape == expected.shape
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
