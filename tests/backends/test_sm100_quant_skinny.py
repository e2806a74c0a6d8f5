"""The sm100 block-scaled grouped GEMM for few rows per expert (``kernels/grouped_gemm_quant_skinny.py``)
without a GPU: when the wrapper picks it, that its K order inside a chunk gives the MMA each product
once (a float64 model of the ``mma.m16n8k16`` fragments it fills), and that it lowers and compiles
for sm_90a on ``mma.sync`` with no shared memory. Its results are checked on the H200 by
``tests/backends/test_sm100_gpu_grouped_gemm.py``. The kernel tests need tilelang (and nvcc)."""
import functools

import pytest
import torch


def test_wrapper_picks_the_skinny_kernel_and_its_tiles_by_rows_per_expert():
    from deepinfer_backends.sm100 import gemm, toolchain

    skinny = ("grouped_gemm_quant_skinny", "grouped_gemm_quant_skinny")
    narrow = {"block_t": 8, "warps": 4, "depth": 2, "tiles_m": 2}
    wide = {"fp8": {"block_t": 16, "warps": 4, "depth": 1, "tiles_m": 2},
            "mxfp4": {"block_t": 16, "warps": 4, "depth": 2, "tiles_m": 2}}
    for w_format in ("fp8", "mxfp4"):
        def pick(rows, experts, n=4096):
            return gemm.quant_kernel(rows, experts, n, 4096, toolchain.HOPPER, w_format=w_format)

        for rows, experts in ((192, 48), (1536, 384), (1, 48)):  # at most 4 rows per expert: 8-row tiles
            assert pick(rows, experts) == (*skinny, narrow)
        for rows, experts in ((193, 48), (384, 48), (768, 48), (6144, 384)):  # up to 16: 16-row tiles
            assert pick(rows, experts) == (*skinny, wide[w_format])
        assert pick(769, 48)[0] == pick(6145, 384)[0] == "grouped_gemm_quant_ws"
        # one expert (linear): 4096 columns make 32 CTAs at two MMA tiles a warp, so one a warp (64 CTAs)
        assert pick(3, 1) == (*skinny, {**narrow, "tiles_m": 1})
        assert pick(16, 1) == (*skinny, {**wide[w_format], "tiles_m": 1})
        assert pick(17, 1)[0] == "grouped_gemm_quant_ws"
        assert pick(3, 1, n=128 * 264)[2]["tiles_m"] == 2 and pick(3, 1, n=128 * 263)[2]["tiles_m"] == 1
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


@functools.lru_cache(maxsize=None)
def _lower(w_format: str, **tiles) -> str:
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100 import toolchain
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant_skinny import grouped_gemm_quant_skinny

    return toolchain.lower_source(grouped_gemm_quant_skinny, 8, 40, 1024, w_format, **tiles)


@pytest.mark.parametrize("w_format", ["fp8", "mxfp4"])
def test_skinny_kernel_decodes_in_registers_into_mma_sync(w_format):
    """The wrapper's tiles: 128 threads; each chunk's raw weight runs and activation runs loaded as
    16-byte vectors into registers (no shared memory), two chunks ahead; the decode-and-MMA device
    function called for this format; nvcc and ptxas accept it, with ``mma.sync`` m16n8k16 bf16
    MMAs, both decode paths behind a warp vote, and no wgmma."""
    from deepinfer_backends.sm100 import gemm, toolchain

    source = _lower(w_format, **gemm.SKINNY_TILES)
    assert "__launch_bounds__(128, 1)" in source and "__shared__" not in source
    body = source[source.index("extern \"C\" __global__"):]
    call = f"sk_chunk<{str(w_format == 'mxfp4').lower()}, 1, {gemm.SKINNY_TILES['tiles_m']}>("
    assert body.count(call) == 1  # the loop over two register slots
    assert "for (int c0 = 0; c0 < 4; ++c0)" in body  # 1024 / 128 chunks, two a turn
    vector = "uint4" if w_format == "mxfp4" else "fp8_e4_16_t"
    assert body.count(f"*({vector}*)(w + ") == 2 and body.count("*(uint4*)(x + ") == 2  # prologue, loop
    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    ptx = toolchain.compile_ptx(source, toolchain.HOPPER)
    assert toolchain.assemble(ptx, toolchain.HOPPER)[:4] == b"\x7fELF"
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "wgmma" not in ptx
    assert "vote.sync.any.pred" in ptx and "mul.rn.bf16x2" in ptx and ".shared" not in ptx


def test_skinny_kernel_shares_activation_runs_between_mma_tiles():
    """``tiles_m = 2``: each thread decodes four weight rows (``g``, ``g + 8`` of two MMA tiles, 32
    rows a warp) against one set of activation runs, and stores both tiles."""
    source = _lower("mxfp4", block_t=8, warps=4, depth=2, tiles_m=2)
    body = source[source.index("extern \"C\" __global__"):]
    assert body.count("sk_chunk<true, 1, 2>(") == 1 and "for (int r = 0; r < 4; ++r)" in body
    assert "(((int)threadIdx.x) >> 5) * 32)" in body  # 32 weight rows a warp


def test_skinny_kernel_refuses_tiles_it_cannot_run():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100 import toolchain
    from deepinfer_backends.sm100.kernels.grouped_gemm_quant_skinny import grouped_gemm_quant_skinny

    for args, tiles, message in (((4, 64, 1024, "nvfp4"), {}, "w_format"),
                                 ((4, 64, 1024, "fp8"), {"block_t": 12}, "block_t=12"),
                                 ((4, 64, 1024, "fp8"), {"block_t": 72}, "block_t=72"),
                                 ((4, 64, 1024, "fp8"), {"warps": 3}, "warps=3"),
                                 ((4, 64, 1024, "fp8"), {"tiles_m": 3}, "tiles_m=3"),
                                 ((4, 64, 384, "fp8"), {"depth": 2}, "k=384"),
                                 ((4, 64, 1024, "fp8"), {"depth": 0}, "depth=0")):
        with pytest.raises(ValueError, match=message):
            toolchain.lower_source(grouped_gemm_quant_skinny, *args, **tiles)
