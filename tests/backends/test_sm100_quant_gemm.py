"""The sm100 block-scaled grouped GEMM without a GPU: the wrapper's refusals and kernel choice, the
portable kernel's decode (emulated in torch) against the HAL formats, and what the kernels the
wrapper serves compile to (``cubin_checks``): every format pair for sm_90a on wgmma, the
warp-specialised Hopper kernel and its activation decode, the portable kernel for sm_100a on
mma.sync, each within a CTA's limits; and the warp-specialised kernel's refusals. The kernel
tests need tilelang and nvcc and skip without them (the default CI)."""
import functools

import pytest
import torch

from deepinfer.hal import get_backend
from deepinfer.hal.formats import Quantized, quantize
from deepinfer.hal.ops.grouped_gemm import grouped_gemm as hal_grouped_gemm
from deepinfer_backends.sm100 import gemm, toolchain
from tests.backends import cubin_checks

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
         r"K=96 must be a multiple of 128"),
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


SERVED = {"128-row tiles": gemm.portable_quant_tiles(16384, 48, 4096, 4096),
          "64-row tiles": gemm.portable_quant_tiles(16384, 48, 4096, 4096, batch_invariant=True)}
"""Tiles the wrapper gives the portable kernel: long segments, and the batch-invariant mode."""


@functools.lru_cache(maxsize=None)
def _compile(x_format: str, w_format: str, tiles: str = "128-row tiles", arch: str = toolchain.HOPPER):
    return cubin_checks.compile_cubin(cubin_checks.lower(_kernel_module().grouped_gemm_quant, 4, 256, 512, x_format,
                                                         w_format, arch=arch, **SERVED[tiles]))


@pytest.mark.parametrize("x_format,w_format", FORMAT_PAIRS)
def test_each_format_pair_compiles_for_hopper_on_wgmma(x_format, w_format):
    """Each pair compiles for sm_90a within a CTA's limits, without spilling: tiles and scale rows
    loaded by TMA, bf16 wgmma into float32 (HGMMA), no mma.sync."""
    cubin = _compile(x_format, w_format)
    cubin_checks.assert_fits(cubin)
    cubin_checks.assert_no_spill(cubin)
    assert cubin.count("UTMALDG") and not cubin.count("HMMA")
    assert any(line.split()[0].startswith("HGMMA.") and line.split()[0].endswith(".F32.BF16") for line in cubin.sass)


def test_decode_tiles_compile_for_hopper_on_wgmma():
    """The 64-row tiles the wrapper picks for short segments (decode) and for batch invariance:
    still two consumer warpgroups sharing the decode, each a 64-row wgmma over half the columns."""
    tiles = SERVED["64-row tiles"]
    cubin = _compile("fp8", "mxfp4", "64-row tiles")
    cubin_checks.assert_fits(cubin)
    cubin_checks.assert_no_spill(cubin)
    assert tiles["block_m"] == 64 and cubin.count(f"HGMMA.64x{tiles['block_n'] // 2}x16.F32.BF16")


def test_compiles_for_blackwell_on_mma():
    """Like the other portable kernels, it compiles for sm_100a on mma.sync (HMMA), within a CTA's
    limits (no tcgen05 variant, no wgmma)."""
    cubin = _compile("fp8", "mxfp4", arch=toolchain.BLACKWELL)
    cubin_checks.assert_fits(cubin)
    assert cubin.count("HMMA") and not cubin.count("HGMMA") and not any(line.startswith("UTC") for line in cubin.sass)


@pytest.mark.xfail(reason="ptxas spills registers in grouped_gemm_quant on sm_100a")
def test_keeps_its_values_in_registers_on_blackwell():
    cubin_checks.assert_no_spill(_compile("fp8", "mxfp4", arch=toolchain.BLACKWELL))


def test_wrapper_picks_the_warp_specialised_kernel_on_hopper_for_k_a_multiple_of_512():
    """64- or 128-row tiles as for bf16, 256 columns, on the decoder-fed kernel (past 16 rows per
    expert, see test_sm100_quant_skinny.py); the portable kernel elsewhere, on the K block whose
    multiples the wrapper requires."""
    module, _, tiles = gemm.quant_kernel(16384, 48, 4096, 4096, toolchain.HOPPER)
    assert module == "grouped_gemm_quant_ws" and (tiles["block_m"], tiles["block_n"]) == (128, 256)
    module, _, tiles = gemm.quant_kernel(1536, 48, 4096, 2048, toolchain.HOPPER)
    assert module == "grouped_gemm_quant_ws" and (tiles["block_m"], tiles["block_n"]) == (64, 256)
    for rows, k, arch, invariant in ((192, 384, toolchain.HOPPER, False), (192, 4096, toolchain.HOPPER, True),
                                     (192, 4096, toolchain.BLACKWELL, False)):
        module, _, tiles = gemm.quant_kernel(rows, 48, 4096, k, arch, batch_invariant=invariant)
        assert module == "grouped_gemm_quant" and tiles["block_n"] == 128 and tiles["block_k"] == gemm.QUANT_BLOCK_K


def _ws_kernels():
    _kernel_module()
    from deepinfer_backends.sm100.kernels import grouped_gemm_quant_ws

    return grouped_gemm_quant_ws


@functools.lru_cache(maxsize=None)
def _compile_ws(w_format: str, rows: int) -> tuple[dict, cubin_checks.Cubin]:
    """The warp-specialised kernel with the tiles the wrapper picks for ``rows`` over 48 experts."""
    tiles = gemm.quant_kernel(rows, 48, 4096, 4096, toolchain.HOPPER, w_format=w_format)[2]
    kernel = cubin_checks.lower(_ws_kernels().grouped_gemm_quant_ws, 4, 512, 1024, w_format, **tiles)
    return tiles, cubin_checks.compile_cubin(kernel)


@pytest.mark.parametrize("w_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rows", [16384, 1536])
def test_warp_specialised_kernel_feeds_bf16_wgmma_from_a_decoder_ring(w_format, rows):
    """The wrapper's two configurations (128-row tiles, and 64-row tiles with more decoders):
    bf16 activations, raw weights and scales by TMA, decoded with bf16 multiplies, fenced to the
    async proxy before the wgmmas read them; within a CTA's limits without spilling, and the two
    consumer warpgroups' and the decoders' register budgets together fit the register file
    (else ``setmaxnreg.inc`` waits forever)."""
    tiles, cubin = _compile_ws(w_format, rows)
    cubin_checks.assert_fits(cubin)
    cubin_checks.assert_no_spill(cubin)
    decoders = cubin.threads // 128 - 2
    assert decoders >= 1 and cubin.count("UTMALDG") and cubin.count("FENCE.VIEW.ASYNC.S")
    assert any(line.split()[0].endswith(".F32.BF16") for line in cubin.sass if line.startswith("HGMMA."))
    assert cubin.count("HMUL2") and not cubin.count("HMMA")
    budgets = cubin.register_budgets()
    consumer, decoder = (max(count for way, count in budgets if way == side) for side in ("ALLOC", "DEALLOC"))
    assert 128 * (2 * consumer + decoders * decoder) <= cubin_checks.REGISTER_FILE


def test_warp_specialised_kernel_refuses_what_it_cannot_run():
    """A K whose scale rows TMA cannot address (not a multiple of 512 values), a register budget
    over the launch's (``setmaxnreg.inc`` would wait forever, as seen on the H200), two decoder
    warpgroups beside 128 x 256 accumulators' worth of registers cut to 128, a raw ring of one
    stage (the next k-block's raw tile must land while this one is decoded: four bf16 stages of
    128 x 256 tiles leave room for one), bad tiles, formats or prefetch orders."""
    grouped_gemm_quant_ws = _ws_kernels().grouped_gemm_quant_ws
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


def test_activation_decode_compiles_for_hopper_with_bf16_multiplies():
    """The FP8 activations' decode ahead of the warp-specialised kernel: within a CTA's limits,
    without spilling, by byte permutes and bf16 multiplies (PRMT, HMUL2) with no float conversion
    instruction (F2F, I2F, F2I)."""
    cubin = cubin_checks.compile_cubin(cubin_checks.lower(_ws_kernels().decode_fp8_rows, 4096))
    cubin_checks.assert_fits(cubin)
    cubin_checks.assert_no_spill(cubin)
    assert cubin.count("PRMT") and cubin.count("HMUL2")
    assert not [line for line in cubin.sass if line.startswith(("F2F", "I2F", "F2I"))]
