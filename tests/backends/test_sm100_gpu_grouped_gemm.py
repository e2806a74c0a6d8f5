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


@pytest.mark.parametrize("limit", [7.0, None])
@pytest.mark.parametrize("segments", sorted(SEGMENTS))
def test_fused_grouped_swiglu_equals_the_two_gemms_and_the_activation(segments, limit):
    """The fused gate/up kernel against the composition it replaces (both grouped GEMMs, then the
    SwiGLU kernel): the same products rounded to bf16, so at most one bf16 step apart where the
    two exponentials differ in their last float32 bit, and almost every element identical."""
    from deepinfer_backends.sm100 import activation, gemm, grouped_swiglu

    sizes = torch.tensor(SEGMENTS[segments]).cuda()
    g = torch.Generator().manual_seed(1)
    n, k = 256, 320
    x = torch.randn(int(sizes.sum()), k, generator=g).bfloat16().cuda()
    w1, w3 = ((torch.randn(len(sizes), n, k, generator=g) * 4 * k ** -0.5).bfloat16().cuda() for _ in range(2))
    fused = grouped_swiglu.fused_grouped_swiglu(x, w1, w3, sizes, limit)
    assert fused is not None and fused.dtype == torch.bfloat16
    composed = activation.swiglu(gemm.grouped_gemm(x, w1, sizes), gemm.grouped_gemm(x, w3, sizes), limit)
    torch.testing.assert_close(fused.float(), composed.float(), rtol=2 ** -7, atol=0.0)
    assert (fused != composed).float().mean().item() < 1e-3


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


QUANT_SEGMENTS = {**SEGMENTS,
                  "64_row_tiles": [0, 1, 5, 63, 0, 2, 40, 33],  # 144 rows over 8 experts: past the skinny kernel's 16
                  "few_rows": [0, 1, 5, 9, 0, 2, 8, 3],  # 28 rows over 8 experts: the skinny kernel, 8-row tiles
                  "few_rows_wide": [0, 1, 5, 19, 0, 2, 30, 33]}  # 90 rows: the skinny kernel, 16-row tiles


@pytest.mark.parametrize("n,k", [(512, 1024), (40, 1024), (512, 384)])
@pytest.mark.parametrize("segments", sorted(QUANT_SEGMENTS))
@pytest.mark.parametrize("x_format,w_format", QUANT_PAIRS)
def test_block_scaled_grouped_gemm_matches_float64_on_ragged_segments(x_format, w_format, segments, n, k):
    """The kernel the wrapper picks (on Hopper for K a multiple of 512 the one for few rows per expert
    on the "few_rows" cases, the warp-specialised one otherwise; the portable one for K = 384; N = 40 leaves
    most of a column tile empty) against float64 sums of the exactly decoded operands."""
    from deepinfer.hal.formats import Quantized
    from deepinfer_backends.sm100 import gemm, toolchain

    sizes = torch.tensor(QUANT_SEGMENTS[segments])
    g = torch.Generator().manual_seed(2)
    x, w = _block_scaled(g, (int(sizes.sum()), k), x_format), _block_scaled(g, (len(sizes), n, k), w_format)
    module, _, tiles = gemm.quant_kernel(int(sizes.sum()), len(sizes), n, k, toolchain.device_arch(),
                                         w_format=w_format)
    if toolchain.device_arch() == toolchain.HOPPER:
        assert module == ("grouped_gemm_quant" if k % 512 else "grouped_gemm_quant_skinny"
                          if segments.startswith("few_rows") else "grouped_gemm_quant_ws")
        if module == "grouped_gemm_quant_skinny":
            assert tiles["block_t"] == (16 if segments == "few_rows_wide" else 8)
    if module != "grouped_gemm_quant_skinny":
        assert tiles["block_m"] == (128 if segments == "128_row_tiles" else 64)
    on_gpu = [Quantized(t.data.cuda(), t.scale.cuda(), t.fmt, t.block) if isinstance(t, Quantized) else t.cuda()
              for t in (x, w)]
    y = get_backend("sm100").implementations()["grouped_gemm"](*on_gpu, sizes.cuda())
    _assert_matches_float64(y, x, w, sizes)


def _assert_matches_float64(y, x, w, sizes):
    """``y`` against float64 sums of the exactly decoded operands, segment by segment."""
    from deepinfer.hal.formats import Quantized

    xs, ws = (t.dequantize().double() if isinstance(t, Quantized) else t.double() for t in (x, w))
    expected, start = torch.empty(xs.shape[0], ws.shape[1], dtype=torch.float64), 0
    for expert, size in enumerate(sizes.tolist()):
        expected[start:start + size] = xs[start:start + size] @ ws[expert].T
        start += size
    assert y.dtype == torch.float32 and y.shape == expected.shape
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


SKINNY_TILES = [dict(zip(("block_t", "warps", "depth", "tiles_m"), tiles)) for tiles in (
    (8, 4, 2, 1), (16, 1, 4, 1), (32, 8, 1, 1), (64, 2, 2, 1),
    (8, 4, 2, 2), (16, 4, 1, 2), (16, 4, 2, 2), (16, 4, 1, 4))]


@pytest.mark.parametrize("tiles", SKINNY_TILES, ids=lambda t: "t{block_t}w{warps}d{depth}m{tiles_m}".format(**t))
@pytest.mark.parametrize("x_format,w_format", QUANT_PAIRS)
def test_skinny_block_scaled_kernel_matches_float64(x_format, w_format, tiles):
    """The kernel for few rows per expert, launched directly with each kind of tile: segments empty,
    of one row, shorter than a tile, of several tiles with a short last one; ``n = 40`` (a warp's
    weight rows partly past ``n``) and ``n = 512``; scale bytes over both decode paths."""
    from deepinfer.hal.formats import Quantized
    from deepinfer_backends.sm100 import gemm
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

    sizes = torch.tensor([0, 1, 7, 8, 9, 0, 70, 3])
    g = torch.Generator().manual_seed(3)
    for n in (40, 512):
        x, w = _block_scaled(g, (int(sizes.sum()), 1024), x_format), _block_scaled(g, (len(sizes), n, 1024), w_format)
        x_data, x_scale = (x.data.cuda(), x.scale.cuda()) if isinstance(x, Quantized) else (x.cuda(), None)
        y = torch.full((x_data.shape[0], n), float("nan"), device="cuda")
        schedule = tile_schedule(sizes.cuda(), x_data.shape[0], tiles["block_t"])
        gemm.run_quant_skinny(x_data, x_scale, w.data.cuda(), w.scale.cuda(), schedule, y, w_format, tiles)
        _assert_matches_float64(y, x, w, sizes)


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("x_format,w_format", [("fp8", "fp8"), ("fp8", "mxfp4"), ("bf16", "fp8")])
def test_block_scaled_linear_of_a_decode_batch_matches_float64(x_format, w_format, rows):
    """``linear`` with a block-scaled weight on a decode batch (at most 16 rows: the skinny kernel with
    one expert, 8- and 16-row tiles) against float64."""
    from deepinfer.hal.formats import Quantized
    from deepinfer_backends.sm100 import gemm, toolchain

    g = torch.Generator().manual_seed(4)
    x, w = _block_scaled(g, (rows, 1024), x_format), _block_scaled(g, (1, 1280, 1024), w_format)
    if toolchain.device_arch() == toolchain.HOPPER:
        assert gemm.quant_kernel(rows, 1, 1280, 1024, toolchain.HOPPER, w_format=w_format)[0] == \
            "grouped_gemm_quant_skinny"
    weight = Quantized(w.data[0].cuda(), w.scale[0].cuda(), w.fmt, w.block)
    x_gpu = Quantized(x.data.cuda(), x.scale.cuda(), x.fmt, x.block) if isinstance(x, Quantized) else x.cuda()
    y = get_backend("sm100").implementations()["linear"](x_gpu, weight)
    _assert_matches_float64(y, x, w, torch.tensor([rows]))
