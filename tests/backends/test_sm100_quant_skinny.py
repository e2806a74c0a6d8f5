"""The sm100 block-scaled grouped GEMM for few rows per expert (``kernels/grouped_gemm_quant_skinny.py``)
without a GPU: when the wrapper picks it, that its K order inside a chunk gives the MMA each product
once (a float64 model of the ``mma.m16n8k16`` fragments it fills), and what it compiles to for
sm_90a (``cubin_checks``): ``mma.sync`` with no shared memory, within a CTA's limits. Its results
are checked on the H200 by ``tests/backends/test_sm100_gpu_grouped_gemm.py``. The kernel tests need
tilelang and nvcc."""
import functools

import pytest
import torch

from deepinfer_backends.sm100 import gemm, toolchain
from tests.backends import cubin_checks

H200_SMS = 132


def test_wrapper_picks_the_skinny_kernel_and_its_tiles_by_rows_per_expert():
    """Up to 16 rows per expert (on average) the kernel for few rows: 8-row tiles up to 4 rows per
    expert, 16-row tiles above; two MMA tiles a warp unless that leaves fewer than two CTAs per SM
    of an H200 (then one: a one-expert ``linear`` of a few thousand columns)."""
    for w_format in ("fp8", "mxfp4"):
        def pick(rows, experts, n=4096):
            return gemm.quant_kernel(rows, experts, n, 4096, toolchain.HOPPER, w_format=w_format)

        for rows, experts, block_t in ((192, 48, 8), (1536, 384, 8), (1, 48, 8), (193, 48, 16), (384, 48, 16),
                                       (768, 48, 16), (6144, 384, 16), (3, 1, 8), (16, 1, 16)):
            module, _, tiles = pick(rows, experts)
            assert module == "grouped_gemm_quant_skinny" and tiles["block_t"] == block_t, (rows, experts)
        assert pick(769, 48)[0] == pick(6145, 384)[0] == pick(17, 1)[0] == "grouped_gemm_quant_ws"
        for rows, experts, n in ((192, 48, 4096), (3, 1, 4096), (16, 1, 4096), (3, 1, 128 * 264), (3, 1, 128 * 263)):
            tiles = pick(rows, experts, n)[2]
            ctas_at_two_tiles = experts * -(-n // (16 * tiles["warps"] * 2))  # 16 weight rows an MMA tile
            assert tiles["tiles_m"] == (2 if ctas_at_two_tiles >= 2 * H200_SMS else 1), (rows, experts, n)
    for k, arch, invariant in ((384, toolchain.HOPPER, False), (4096, toolchain.HOPPER, True),
                               (4096, toolchain.BLACKWELL, False)):
        assert gemm.quant_kernel(192, 48, 4096, k, arch, batch_invariant=invariant)[0] == "grouped_gemm_quant"


def _fragments(run: torch.Tensor, rows_a: bool) -> list[torch.Tensor]:
    """The kernel's operands of each 16-wide step of one 128-value chunk, laid out as PTX's
    ``mma.m16n8k16`` reads them: ``run[r, t]`` is the 32 values thread column ``t`` holds of row
    ``r`` (a weight row for A, 16 of them; a tile row for B, 8), step ``s`` its values ``4s .. 4s+3``.
    A[g or g + 8][k] and B[k][g] at K position ``2t + p`` (values ``4s + p``) and ``2t + 8 + p``
    (``4s + 2 + p``)."""
    steps = []
    for s in range(8):
        m = torch.zeros(run.shape[0], 16, dtype=run.dtype)
        for t in range(4):
            for p in range(2):
                m[:, 2 * t + p] = run[:, t, 4 * s + p]
                m[:, 2 * t + 8 + p] = run[:, t, 4 * s + 2 + p]
        steps.append(m if rows_a else m.T)
    return steps


def test_chunk_order_gives_the_mma_each_product_once():
    """Thread column ``t`` taking values ``32t .. 32t + 31`` of a chunk for A and B alike makes the
    sum of the eight ``16 x 16 @ 16 x 8`` steps the chunk's ``w @ x^T``, in float64."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 128, generator=g, dtype=torch.float64), torch.randn(8, 128, generator=g, dtype=torch.float64)
    a_steps, b_steps = _fragments(w.reshape(16, 4, 32), True), _fragments(x.reshape(8, 4, 32), False)
    got = sum(a @ b for a, b in zip(a_steps, b_steps))
    torch.testing.assert_close(got, w @ x.T, rtol=1e-12, atol=1e-12)
    # each thread column's 32 values are one UE8M0 scale block: scaling one changes only its own products
    x2 = x.clone()
    x2[:, 32:64] *= 4
    got2 = sum(a @ b for a, b in zip(a_steps, _fragments(x2.reshape(8, 4, 32), False)))
    torch.testing.assert_close(got2 - got, 3 * w[:, 32:64] @ x[:, 32:64].T, rtol=1e-12, atol=1e-12)


def _factory():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant_skinny import grouped_gemm_quant_skinny

    return grouped_gemm_quant_skinny


def _served(w_format: str) -> dict:
    """The tiles the wrapper picks for 4 rows per expert over 48 experts."""
    return gemm.quant_kernel(192, 48, 4096, 4096, toolchain.HOPPER, w_format=w_format)[2]


@functools.lru_cache(maxsize=None)
def _compile(w_format: str, **tiles) -> cubin_checks.Cubin:
    return cubin_checks.compile_cubin(cubin_checks.lower(_factory(), 8, 40, 1024, w_format, **tiles))


@pytest.mark.parametrize("w_format", ["fp8", "mxfp4"])
def test_skinny_kernel_decodes_in_registers_into_mma_sync(w_format):
    """The wrapper's tiles: a warp per 32 threads, within a CTA's limits and without spilling; raw
    weights and activations loaded as 16-byte vectors straight into registers (no shared memory
    at all), decoded with bf16 multiplies into ``mma.sync`` m16n8k16 bf16 MMAs (HMMA.16816), no wgmma."""
    tiles = _served(w_format)
    cubin = _compile(w_format, **tiles)
    cubin_checks.assert_fits(cubin)
    cubin_checks.assert_no_spill(cubin)
    assert cubin.threads == 32 * tiles["warps"] and cubin.static_shared == cubin.dynamic_shared == 0
    assert not [line for line in cubin.sass if line.startswith(("LDS", "STS", "LDSM", "STSM"))]
    assert cubin.count("LDG.E.128") and cubin.count("HMUL2")
    assert cubin.count("HMMA.16816.F32.BF16") and not cubin.count("HGMMA")


def test_skinny_kernel_shares_activation_runs_between_mma_tiles():
    """Two MMA tiles a warp decode twice the weight rows against one set of activation runs: twice
    the MMAs of one tile a warp, with fewer than twice its 16-byte loads."""
    tiles = _served("mxfp4")
    one, two = (_compile("mxfp4", **{**tiles, "tiles_m": tiles_m}) for tiles_m in (1, 2))
    assert two.count("HMMA") == 2 * one.count("HMMA")
    assert one.count("LDG.E.128") < two.count("LDG.E.128") < 2 * one.count("LDG.E.128")


def test_skinny_kernel_refuses_tiles_it_cannot_run():
    grouped_gemm_quant_skinny = _factory()
    for args, tiles, message in (((4, 64, 1024, "nvfp4"), {}, "w_format"),
                                 ((4, 64, 1024, "fp8"), {"block_t": 12}, "block_t=12"),
                                 ((4, 64, 1024, "fp8"), {"block_t": 72}, "block_t=72"),
                                 ((4, 64, 1024, "fp8"), {"warps": 3}, "warps=3"),
                                 ((4, 64, 1024, "fp8"), {"tiles_m": 3}, "tiles_m=3"),
                                 ((4, 64, 384, "fp8"), {"depth": 2}, "k=384"),
                                 ((4, 64, 1024, "fp8"), {"depth": 0}, "depth=0")):
        with pytest.raises(ValueError, match=message):
            toolchain.lower_source(grouped_gemm_quant_skinny, *args, **tiles)
