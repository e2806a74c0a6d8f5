"""The sm100 block-scaled grouped GEMM without a GPU: the wrapper's refusals, the kernel's decode
(emulated in torch) against the HAL formats, every format pair lowering for sm_90a on wgmma, one
pair compiling through nvcc and ptxas, and one lowering for sm_100a. The kernel tests need
tilelang and skip without it (the default CI); the compile test also needs nvcc."""
import functools

import pytest
import torch

from deepinfer.hal import get_backend
from deepinfer.hal.formats import Quantized, quantize
from deepinfer.hal.ops.grouped_gemm import grouped_gemm as hal_grouped_gemm

FORMAT_PAIRS = [("bf16", "fp8"), ("bf16", "mxfp4"), ("fp8", "fp8"), ("fp8", "mxfp4")]


def _kernel_module():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100.kernels import grouped_gemm_quant

    return grouped_gemm_quant


def test_wrapper_refuses_quantized_inputs_it_does_not_cover():
    from deepinfer_backends.sm100.wrappers import UnsupportedInput

    gemm = get_backend("sm100").implementations()["grouped_gemm"]
    x, w, sizes = torch.randn(4, 128), torch.randn(2, 16, 128), torch.tensor([1, 3])
    refusals = [
        ((x.bfloat16(), quantize(w, "nvfp4", 16)), r"weight Quantized 'fp8' or 'mxfp4' with block 32, got "
                                                   r"Quantized 'nvfp4' with block 16"),
        ((quantize(x, "mxfp4"), quantize(w, "fp8")), r"x must be bfloat16 or Quantized 'fp8' with block 32, got "
                                                     r"Quantized 'mxfp4'"),
        ((x, quantize(w, "mxfp4")), r"x must be a bfloat16 CUDA tensor, got torch.float32 on cpu"),
        ((quantize(x[:, :96], "fp8"), quantize(w[..., :96], "fp8")),
         r"K=96 must be a multiple of 128 and at most 8192"),
        ((quantize(x, "fp8"), quantize(w, "mxfp4")), r"operands must be CUDA tensors, got \['cpu'"),
    ]
    for (a, b), message in refusals:
        with pytest.raises(UnsupportedInput, match=message + r".*overrides\.grouped_gemm=reference"):
            gemm(a, b, sizes)
    with pytest.raises(ValueError, match=r"weight: K=128 with scale \(2, 16, 2\)"):
        q = quantize(w, "fp8")
        gemm(quantize(x, "fp8"), Quantized(q.data, q.scale[..., :2], "fp8"), sizes)


def test_decode_is_exact_against_the_hal_formats():
    """Every finite e4m3 code and every e2m1 byte, over scale bytes 2^-27 .. 2^33 (bf16 normals)."""
    kernel = _kernel_module()
    codes = torch.arange(256, dtype=torch.uint8)
    e4m3 = codes[(codes & 0x7F) != 0x7F].repeat(8)[:1920].view(torch.float8_e4m3fn).reshape(4, 480)
    e2m1 = (torch.arange(960) % 256).to(torch.uint8).reshape(4, 240)
    scale = torch.randint(100, 161, (4, 15), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    for data, fmt in ((e4m3, "fp8"), (e2m1, "mxfp4")):
        decoded = kernel.decode(data, scale, fmt)
        assert decoded.dtype == torch.bfloat16
        assert torch.equal(decoded.float(), Quantized(data, scale, fmt).dequantize())


@pytest.mark.parametrize("x_format,w_format", FORMAT_PAIRS)
def test_kernel_reference_matches_the_hal_reference(x_format, w_format):
    """The torch model of the kernel (exact decode to bf16, float32 products) is the HAL's result."""
    kernel = _kernel_module()
    gen = torch.Generator().manual_seed(1)
    sizes = torch.tensor([3, 0, 70, 1])
    x_plain = torch.randn(int(sizes.sum()), 256, generator=gen).to(torch.bfloat16)
    x = x_plain if x_format == "bf16" else quantize(x_plain, "fp8")
    weight = quantize(torch.randn(4, 40, 256, generator=gen) / 16, w_format)
    x_data, x_scale = (x, None) if x_format == "bf16" else (x.data, x.scale)
    got = kernel.reference(x_data, x_scale, weight.data, weight.scale, sizes, x_format, w_format)
    want = hal_grouped_gemm(x, weight, sizes)
    assert want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@functools.lru_cache(maxsize=None)
def _lower(x_format: str, w_format: str, arch: str = "sm_90a", **tiles) -> str:
    from deepinfer_backends.sm100 import toolchain

    return toolchain.lower_source(_kernel_module().grouped_gemm_quant, 4, 256, 512, x_format, w_format, arch=arch,
                                  **tiles)


@pytest.mark.parametrize("x_format,w_format", FORMAT_PAIRS)
def test_each_format_pair_lowers_for_hopper_on_wgmma(x_format, w_format):
    """128-row tiles (two consumer warpgroups): raw tiles and scale rows by TMA, bf16 wgmma."""
    source = _lower(x_format, w_format)
    assert "__global__ void __launch_bounds__(384, 1)" in source
    assert "tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in source
    assert "w_scale_desc" in source and ("x_scale_desc" in source) == (x_format == "fp8")
    assert ("__tl_cvt_fp8x2_to_float2" in source) == ("fp8" in (x_format, w_format))


def test_decode_tiles_lower_for_hopper_on_wgmma():
    """The 64-row tiles the wrapper picks for short segments (decode) and for batch invariance:
    still two consumer warpgroups (64 x 64 wgmma each), to share the decode."""
    source = _lower("fp8", "mxfp4", block_m=64)
    assert "__launch_bounds__(384, 1)" in source
    assert "tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 64, 16" in source


def test_one_format_pair_compiles_for_hopper_with_nvcc():
    from deepinfer_backends.sm100 import toolchain

    _kernel_module()
    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    ptx = toolchain.compile_ptx(_lower("fp8", "mxfp4"), toolchain.HOPPER)
    assert toolchain.assemble(ptx, toolchain.HOPPER)[:4] == b"\x7fELF"
    assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync.aligned" not in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads


def test_lowers_for_blackwell_on_mma():
    """Like the other portable kernels, it lowers for sm_100a on mma.sync (no tcgen05 variant)."""
    source = _lower("fp8", "mxfp4", arch="sm_100a")
    assert "tl::mma_sync" in source and "wgmma" not in source and "tcgen05" not in source
