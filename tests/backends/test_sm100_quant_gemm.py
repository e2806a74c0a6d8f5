"""The sm100 block-scaled grouped GEMM without a GPU: the wrapper's refusals and kernel choice, the
portable kernel's decode (emulated in torch) against the HAL formats, every format pair lowering
for sm_90a on wgmma, the warp-specialised Hopper kernel's structure and refusals, one kernel of
each compiling through nvcc and ptxas, and one lowering for sm_100a. The kernel tests need
tilelang and skip without it (the default CI); the compile tests also need nvcc."""
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


def test_wrapper_picks_the_warp_specialised_kernel_on_hopper_for_k_a_multiple_of_512():
    """64- or 128-row tiles as for bf16, on the decoder-fed kernel (past 16 rows per expert, see
    test_sm100_quant_skinny.py); the portable kernel elsewhere."""
    from deepinfer_backends.sm100 import gemm, toolchain

    module, _, tiles = gemm.quant_kernel(16384, 48, 4096, 4096, toolchain.HOPPER)
    assert module == "grouped_gemm_quant_ws" and tiles == {"block_m": 128, "block_n": 256, **gemm.QUANT_WS_TILES[128]}
    module, _, tiles = gemm.quant_kernel(1536, 48, 4096, 2048, toolchain.HOPPER)
    assert module == "grouped_gemm_quant_ws" and tiles == {"block_m": 64, "block_n": 256, **gemm.QUANT_WS_TILES[64]}
    for rows, k, arch, invariant in ((192, 384, toolchain.HOPPER, False), (192, 4096, toolchain.HOPPER, True),
                                     (192, 4096, toolchain.BLACKWELL, False)):
        module, _, tiles = gemm.quant_kernel(rows, 48, 4096, k, arch, batch_invariant=invariant)
        assert module == "grouped_gemm_quant" and tiles["block_n"] == 128 and tiles["block_k"] == gemm.QUANT_BLOCK_K


@functools.lru_cache(maxsize=None)
def _lower_ws(w_format: str, **tiles) -> str:
    from deepinfer_backends.sm100 import toolchain

    _kernel_module()
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant_ws import grouped_gemm_quant_ws

    return toolchain.lower_source(grouped_gemm_quant_ws, 4, 512, 1024, w_format, **tiles)


@pytest.mark.parametrize("w_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("decoders", [1, 2])
def test_warp_specialised_kernel_feeds_bf16_wgmma_from_a_decoder_ring(w_format, decoders):
    """The wrapper's two configurations (128-row tiles with one decoder warpgroup, 64-row tiles with
    two): bf16 activations by TMA, raw weights and their scale boxes by TMA, both decode paths (one
    multiply, and the wide one) chosen once a k-block for each of the two register buffers, the next
    k-block's raw units loaded after the decode (one decoder warpgroup) or before it (two), a proxy
    fence before each hand-off, and a ``ready`` barrier that counts the decoders and the
    activations' TMA."""
    from deepinfer_backends.sm100 import gemm

    block_m = 128 if decoders == 1 else 64
    source = _lower_ws(w_format, block_m=block_m, **gemm.QUANT_WS_TILES[block_m])
    assert f"__launch_bounds__({256 + 128 * decoders}, 1)" in source
    assert "tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in source
    decode = "gq_fp4x32" if w_format == "mxfp4" else "gq_fp8x16"
    assert f"{decode}<false>(" in source and f"{decode}<true>(" in source
    assert "if (wide0[0] != 0)" in source and "if (wide1[0] != 0)" in source
    body = source[source.index("for (int kb2 = 0;"):]
    next_raw, this_free, this_decode = body.index("raw_full["), body.index("free["), body.index(f"{decode}<")
    if gemm.QUANT_WS_TILES[block_m]["prefetch"] == "before":
        assert next_raw < this_free < this_decode
    else:
        assert this_free < this_decode < next_raw
    assert "tma_load(x_desc, ready[" in source and "tma_load(w_scale_desc, raw_full[" in source
    assert "x_scale" not in source  # FP8 activations are decoded before this kernel
    assert f"ready[0].init({128 * decoders + 1})" in source and "tl::fence_proxy_async();" in source
    assert f"tl::__sync_thread_partial(1, {128 * decoders})" in source
    consumer, decoder = (200, 104) if decoders == 1 else (160, 96)
    assert f"warpgroup_reg_alloc<{consumer}>" in source and f"warpgroup_reg_dealloc<{decoder}>" in source


def test_warp_specialised_kernel_refuses_what_it_cannot_run():
    """A K whose scale rows TMA cannot address (not a multiple of 512 values), a register budget
    over the launch's (``setmaxnreg.inc`` would wait forever, as seen on the H200), two decoder
    warpgroups beside 128 x 256 accumulators' worth of registers cut to 128, a raw ring of one
    stage (the next k-block's raw tile must land while this one is decoded: four bf16 stages of
    128 x 256 tiles leave room for one), bad tiles, formats or prefetch orders."""
    from deepinfer_backends.sm100 import toolchain

    _kernel_module()
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant_ws import grouped_gemm_quant_ws

    for args, tiles, message in (((4, 512, 768, "fp8"), {}, "multiple of 512"),
                                 ((4, 512, 1024, "fp8"), {"registers": (208, 104)}, "registers"),
                                 ((4, 512, 1024, "fp8"), {"registers": (200, 100)}, "registers"),
                                 ((4, 512, 1024, "fp8"), {"block_m": 32}, "block_m=32"),
                                 ((4, 512, 1024, "fp8"), {"prefetch": "never"}, "prefetch"),
                                 ((4, 512, 1024, "fp8"), {"num_stages": 4}, r"raw_stages=1 in \[2, 8\]"),
                                 ((4, 512, 1024, "fp8"), {"decoders": 2}, "ptxas needs 154"),
                                 ((4, 512, 1024, "mxfp4"), {"block_m": 64, "block_n": 64, "decoders": 2}, "evenly"),
                                 ((4, 512, 1024, "nvfp4"), {}, "w_format")):
        with pytest.raises(ValueError, match=message):
            toolchain.lower_source(grouped_gemm_quant_ws, *args, **tiles)


def test_warp_specialised_kernel_and_activation_decode_compile_for_hopper_with_nvcc():
    from deepinfer_backends.sm100 import toolchain

    _kernel_module()
    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant_ws import decode_fp8_rows

    ptx = toolchain.compile_ptx(_lower_ws("mxfp4", block_m=128, num_stages=3), toolchain.HOPPER)
    assert toolchain.assemble(ptx, toolchain.HOPPER)[:4] == b"\x7fELF"
    assert "wgmma.mma_async.sync.aligned" in ptx and "setmaxnreg.inc.sync.aligned.u32 200" in ptx
    assert "mul.rn.bf16x2" in ptx and "prmt.b32" in ptx
    decode = toolchain.lower_source(decode_fp8_rows, 4096)
    assert "gq_fp8x16<true>(" in decode
    assert toolchain.assemble(toolchain.compile_ptx(decode, toolchain.HOPPER), toolchain.HOPPER)[:4] == b"\x7fELF"
