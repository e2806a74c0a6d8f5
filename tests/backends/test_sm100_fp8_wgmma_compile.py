"""The native-FP8 block-scaled grouped GEMM (``kernels/experimental/grouped_gemm_fp8_wgmma.py``) without a GPU:
every tile configuration its ``main()`` sweeps compiles for sm_90a, with FP8 and MXFP4 weights,
within a CTA's limits, on e4m3 wgmma (QGMMA) that ptxas keeps asynchronous; the MXFP4 decode's
bit placement; and the refusals. The kernel tests need tilelang and nvcc and skip without them."""
import functools

import pytest
import torch

from tests.backends import cubin_checks

SHAPE = (4, 512, 1024)  # experts, n, k: every swept tile divides them


def _module():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100.kernels.experimental import grouped_gemm_fp8_wgmma

    return grouped_gemm_fp8_wgmma


@functools.lru_cache(maxsize=None)
def _compile(w_format: str, config: int) -> cubin_checks.Cubin:
    module = _module()
    return cubin_checks.compile_cubin(cubin_checks.lower(module.grouped_gemm_fp8_wgmma, *SHAPE, w_format,
                                                         **module.SWEEP[config]))


# the experimental kernel is never served: its MXFP4 weights (the same pipeline behind a decode) compile with
# --runslow
@pytest.mark.parametrize("w_format", ["fp8", pytest.param("mxfp4", marks=pytest.mark.slow)])
def test_every_swept_config_compiles_for_hopper_on_fp8_wgmma(w_format):
    """Each configuration ``main()`` sweeps: within a CTA's limits (the warpgroups' ``setmaxnreg``
    budgets within the launch's registers), at most one spilled register (the 64 x 256 MXFP4 tile
    keeps one value of the tile schedule in local memory), TMA loads and an e4m3 x e4m3 wgmma (QGMMA)
    per 32 values of K, no bf16 tensor-core instruction; ptxas keeps the wgmmas asynchronous (no
    serialization warning) and, with two partials, waits for all but one before a promotion."""
    module = _module()
    for config, tiles in enumerate(module.SWEEP):
        cubin = _compile(w_format, config)
        where = f"{w_format} {tiles}:\n{cubin.report}"
        cubin_checks.assert_fits(cubin)
        assert cubin.spilled <= 16 and "C7514" not in cubin.report, where
        wg_n = tiles["block_n"] if tiles["block_m"] == 128 else tiles["block_n"] // 2
        assert {line.split()[0] for line in cubin.sass if line.startswith("QGMMA.")} == \
            {f"QGMMA.64x{wg_n}x32.F32.E4M3.E4M3"}, where
        assert cubin.count("UTMALDG") and not cubin.count("HGMMA") and not cubin.count("HMMA"), where
        waits = {line.split()[-1] for line in cubin.sass if line.startswith("WARPGROUP.DEPBAR.LE")}
        assert waits == ({"0x1", "0x0"} if tiles["partials"] == 2 else {"0x0"}), where
        consumer, producer = (max(count for way, count in cubin.register_budgets() if way == side)
                              for side in ("ALLOC", "DEALLOC"))
        assert 256 * consumer + 128 * producer <= cubin.registers * cubin.threads, where


def test_mxfp4_codes_land_on_e4m3_times_two_to_the_minus_six():
    """The decode's bit placement: e2m1 code ``s ee m`` as the e4m3 byte ``s 0ee m00`` is the e2m1
    value times 2^-6 for all 16 codes (0.5, e2m1's subnormal, on e4m3's subnormal 2^-7)."""
    from deepinfer.hal.formats import Quantized

    codes = torch.arange(32, dtype=torch.uint8) % 16
    placed = (((codes & 8) << 4) | ((codes & 7) << 2)).view(torch.float8_e4m3fn).float()
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    values = Quantized(packed, torch.full((1, 1), 127, dtype=torch.uint8), "mxfp4").dequantize().flatten()
    assert torch.equal(placed * 64, values)


def test_kernel_refuses_tiles_it_cannot_run():
    """Row tiles other than 64 or 128, columns that do not divide n, partial tiles over the
    consumers' registers, a K block not a multiple of 64, a ring that does not fit, a bad format."""
    from deepinfer_backends.sm100 import toolchain

    kernel = _module().grouped_gemm_fp8_wgmma
    for args, tiles, message in (((4, 512, 1024, "fp8"), {"block_m": 32}, "block_m=32"),
                                 ((4, 384, 1024, "fp8"), {"block_n": 256}, "must divide n=384"),
                                 ((4, 512, 1024, "fp8"), {"block_n": 256}, "need 384 registers"),
                                 ((4, 512, 1024, "fp8"), {"block_k": 96}, "multiple of 64"),
                                 ((4, 512, 1024, "fp8"), {"num_stages": 7}, "num_stages=7"),
                                 ((4, 512, 1024, "nvfp4"), {}, "w_format")):
        with pytest.raises(ValueError, match=message):
            toolchain.lower_source(kernel, *args, **tiles)
