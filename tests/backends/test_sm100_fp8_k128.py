"""The native-FP8 grouped GEMM with activation scales per 128 along K and one weight scale per
output column (``kernels/grouped_gemm_fp8_k128.py``, ``backend.options.quant_gemm=native``): the
alignment of per-32 operands on the CPU (hand-worked bytes, MXFP4 exactness per 128 and per row,
the error bound), the Triton aligner's bytes against the rule's, the kernel's compile for sm_90a,
and on a GPU (skipped without one) the kernel against float64 on its own operands and the op
against the reference backend's grouped GEMM."""
import pytest
import torch

from deepinfer.hal.formats import Quantized, dequantize, quantize

from deepinfer_backends.sm100 import fp8_scales


def _kernel_module():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100.kernels import grouped_gemm_fp8_k128

    return grouped_gemm_fp8_k128


def _fp8_rows(values: list[float], scale_bytes: list[int]) -> Quantized:
    data = torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn).reshape(1, -1)
    return Quantized(data, torch.tensor([scale_bytes], dtype=torch.uint8), "fp8", 32)


def test_alignment_shifts_each_block_to_the_groups_largest_scale():
    # four blocks of 32 with scale exponents 0, -1, -2 and -6 (bytes 127, 126, 125, 121): the group
    # keeps 2^0; block b's values are multiplied by 2^-{0, 1, 2, 6} and rounded to e4m3
    values = [3.0] * 32 + [1.75] * 32 + [448.0] * 32 + [0.01953125] * 32  # 0.01953125 = 1.25 * 2^-6
    q = _fp8_rows(values, [127, 126, 125, 121])
    data, scale = fp8_scales.aligned(q)
    assert scale.tolist() == [[1.0]]
    got = data.float()[0].reshape(4, 32)[:, 0].tolist()
    # 1.25 * 2^-12 is below e4m3's smallest subnormal step 2^-9: it rounds to 0 (0.3125 steps)
    assert got == [3.0, 0.875, 112.0, 0.0]


def test_alignment_rounds_subnormals_to_nearest_even():
    # a block one binade below its group: 1.125 * 2^-6 becomes 1.125 * 2^-7 = 4.5 * 2^-9, which
    # ties to the even 4 * 2^-9; 1.375 * 2^-6 becomes 5.5 * 2^-9 and goes to 6 * 2^-9
    q = _fp8_rows([1.0] * 32 + [1.125 * 2 ** -6] * 16 + [1.375 * 2 ** -6] * 16 + [1.0] * 64, [130, 129, 130, 129])
    data, scale = fp8_scales.aligned(q)
    assert scale.tolist() == [[8.0]]
    column = data.float()[0]
    assert column[32].item() == 4 * 2 ** -9 and column[48].item() == 6 * 2 ** -9
    assert column[0].item() == 1.0 and column[96].item() == 0.5


def test_zero_scale_byte_reads_as_a_zero_block():
    q = _fp8_rows([2.0] * 128, [0, 127, 127, 127])
    data, scale = fp8_scales.aligned(q)
    assert data.float()[0, :32].abs().sum().item() == 0 and data.float()[0, 32:].eq(2.0).all()


def test_mxfp4_weights_align_exactly_when_scales_span_fourteen_binades():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 512, generator=g)
    w = w * torch.exp2(torch.randint(-7, 7, (3, 8, 16), generator=g).float()).repeat_interleave(32, -1)
    q = quantize(w, "mxfp4")
    exponents = q.scale.int().unflatten(-1, (-1, 4))
    assert (exponents.amax(-1) - exponents.amin(-1)).max() == 14  # the widest span kept exact
    data, scale = fp8_scales.aligned(q)
    restored = data.double() * scale.double().repeat_interleave(128, -1)
    assert torch.equal(restored, dequantize(q).double())


def test_weight_rows_align_to_one_scale_exactly_when_their_scales_span_fourteen_binades():
    # every row's 16 scale bytes lie in 118 .. 132 and take both ends: a span of 14 binades
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (2, 8, 256), generator=g, dtype=torch.uint8)
    exponents = torch.randint(118, 133, (2, 8, 16), generator=g, dtype=torch.uint8)
    exponents[..., 3], exponents[..., 11] = 118, 132
    q = Quantized(codes, exponents, "mxfp4", 32)
    data, scale = fp8_scales.aligned(q, group=None)
    assert scale.shape == (2, 8)
    # the row's largest exponent is kept: byte - 127 - 6 (e2m1 values held times 2^6)
    assert torch.equal(scale, torch.full((2, 8), 2.0 ** (132 - 133)))
    assert torch.equal(data.double() * scale.double()[..., None], dequantize(q).double())


def test_fp8_alignment_error_is_bounded_by_the_subnormal_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1024, generator=g) * torch.exp2(torch.randint(-4, 5, (64, 32), generator=g).float()
                                                         ).repeat_interleave(32, -1)
    q = quantize(x, "fp8")
    data, scale = fp8_scales.aligned(q)
    restored = data.double() * scale.double().repeat_interleave(128, -1)
    exact = dequantize(q).double()
    # a shifted value stays exact in e4m3's normal range, else it moves by at most half of 2^-9 of its scale
    bound = 2.0 ** -10 * scale.double().repeat_interleave(128, -1)
    assert ((restored - exact).abs() <= bound).all()
    assert (restored == exact).double().mean() > 0.99


def test_tile_scales_gather_each_tiles_rows_k_major():
    # 3 rows, 2 groups; tile 0 covers rows [2, 3), tile 1 rows [0, 2): other slots read 1
    x_scale = torch.tensor([[2.0, 20.0], [4.0, 40.0], [8.0, 80.0]])
    schedule = torch.tensor([[1, 0], [2, 0], [3, 2]], dtype=torch.int32)
    got = fp8_scales.tile_scales(x_scale, schedule)
    assert got.shape == (2, 256) and got.is_contiguous()
    assert got[:, :2].tolist() == [[8.0, 1.0], [80.0, 1.0]]
    assert got[:, 128:131].tolist() == [[2.0, 4.0, 1.0], [20.0, 40.0, 1.0]]
    assert (got[:, 2:128] == 1.0).all() and (got[:, 130:] == 1.0).all()


ALIGNER = """
import sys
import torch
from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_gemm import tile_bounds
from deepinfer_backends.sm100 import fp8_scales
from deepinfer_backends.sm100.fused.align_fp8 import align_fp8

sizes = [int(s) for s in sys.argv[1].split(",")]
rows = sum(sizes)
g = torch.Generator().manual_seed(rows)
codes = torch.arange(256, dtype=torch.uint8).repeat(rows, 2)
codes[(codes & 0x7F) == 0x7F] = 0x12
codes = codes[:, torch.randperm(512, generator=g)]
scale = torch.randint(100, 140, (rows, 16), generator=g, dtype=torch.uint8)
scale[0, 1] = 0
scale[-1, 4:8] = 0
q = Quantized(codes.view(torch.float8_e4m3fn), scale, "fp8", 32)
schedule = torch.stack(tile_bounds(torch.tensor(sizes), rows, fp8_scales.BLOCK_M)).to(torch.int32)
want, want_scale = fp8_scales.aligned(q)
got, got_scale = align_fp8(q.data, q.scale, schedule)
assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "aligned bytes differ"
assert torch.equal(got_scale, fp8_scales.tile_scales(want_scale, schedule)), "tile scales differ"
print("aligner ok")
"""


@pytest.mark.parametrize("sizes", ["1", "0,37,130,0,5"])
def test_triton_aligner_writes_the_rules_bytes(sizes):
    """Every non-NaN e4m3 code under scale bytes 100 .. 139 and some 0 (zero blocks), rows in ragged
    segments (empty ones, one over a tile), through
    :func:`~deepinfer_backends.sm100.fused.align_fp8.align_fp8` under Triton's interpreter: the
    bytes of :func:`~deepinfer_backends.sm100.fp8_scales.aligned` and its scales laid out by
    :func:`~deepinfer_backends.sm100.fp8_scales.tile_scales`."""
    pytest.importorskip("triton")
    from tests.backends.test_sm100_fused import interpreted

    assert interpreted(ALIGNER, sizes).strip() == "aligner ok"


def test_kernel_compiles_for_hopper():
    import shutil

    from deepinfer_backends.sm100.launch import compile_kernel

    fp8_k128 = _kernel_module()
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    kernel = compile_kernel(fp8_k128.MODULE, "grouped_gemm_fp8_k128", (4, 384, 640), {}, "sm_90a")
    assert kernel is not None


def test_native_option_takes_several_column_blocks_a_cta_only_for_bf16_results_with_waves_to_spare():
    from deepinfer_backends.sm100.grouped_gemm_native import native_blocks

    # 4096 columns are 20 blocks of 208: 384 row tiles x 4 CTA columns = 1536 CTAs >= 2 x 132
    assert native_blocks(49152, 4096, 132, bf16=True) == 5
    assert native_blocks(49152, 4096, 132, bf16=False) == 1
    # 48 row tiles: 5 blocks a CTA would leave 192 CTAs (< 264), 2 blocks 480
    assert native_blocks(6144, 4096, 132, bf16=True) == 2
    assert native_blocks(1024, 4096, 132, bf16=True) == 1  # 8 tiles: one block a CTA
    # 1536 columns are 8 blocks: 5 does not divide them
    assert native_blocks(49152, 1536, 132, bf16=True) == 2
    assert native_blocks(49152, 208 * 7, 132, bf16=True) == 1


def test_kernel_refuses_a_bf16_result_it_cannot_store_whole():
    fp8_k128 = _kernel_module()
    with pytest.raises(ValueError, match="bfloat16 needs n=100 a multiple of 8"):
        fp8_k128.grouped_gemm_fp8_k128.get_tir(4, 100, 640, out_dtype="bfloat16")
    with pytest.raises(ValueError, match="must be one of"):
        fp8_k128.grouped_gemm_fp8_k128.get_tir(4, 128, 640, out_dtype="float16")


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, tiles", [(384, {}), (200, {}), (576, {"block_n": 192}),
                                      (384, {"out_dtype": "bfloat16"}), (200, {"out_dtype": "bfloat16"}),
                                      (576, {"block_n": 192, "out_dtype": "bfloat16"}),
                                      (576, {"out_dtype": "bfloat16", "blocks": 2}),
                                      (200, {"out_dtype": "bfloat16", "blocks": 5}), (384, {"blocks": 2})])
def test_kernel_matches_float64_on_its_operands(n, tiles):
    """Ragged segments (empty ones, a row alone, tiles past a segment's end) and partial column
    blocks (200 and 576 columns), float32 or bf16 result; several column blocks a CTA, some of
    them past ``n`` (576 columns are 3 blocks of 208, 200 columns 1)."""
    kernel = _kernel_module()

    g = torch.Generator().manual_seed(2)
    sizes = torch.tensor([0, 130, 1, 255, 64, 0, 300])
    k = 640
    x = torch.randn(int(sizes.sum()), k, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(len(sizes), n, k, generator=g).to(torch.float8_e4m3fn)
    x_scale = torch.exp2(torch.randint(-6, 2, (x.shape[0], k // 128), generator=g).float())
    w_scale = torch.exp2(torch.randint(-6, 2, (len(sizes), n), generator=g).float())
    args = [t.cuda() for t in (x, x_scale, w, w_scale, sizes)]
    y = kernel.run(*args, **tiles)
    expected = kernel.reference(*args)
    assert y.dtype == (torch.bfloat16 if tiles.get("out_dtype") else torch.float32)
    # the tensor cores accumulate a k-block's e4m3 products in fewer bits than float32 has; a bf16
    # result may differ by its rounding besides
    rounding = expected.abs() * 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0
    assert ((y.float() - expected).abs() - rounding).max() <= 2 ** -10 * expected.abs().max()
    if y.dtype == torch.bfloat16:  # every element written, each rounded once from the float32 kernel's value
        exact = kernel.run(*args, **{**tiles, "out_dtype": "float32"})
        assert ((y.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 2 ** -10 * expected.abs().max()).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("w_format, out_dtype", [("fp8", None), ("mxfp4", None), ("mxfp4", torch.bfloat16)])
def test_native_option_serves_the_kernel_within_its_tolerance_of_the_reference(w_format, out_dtype):
    """``quant_gemm=native``: the op's result is the kernel's on the aligned operands, bit for bit,
    and within the alignment and FP8 accumulation of the reference backend's exact numbers;
    ``exact`` (the default) stays within float32 summation order of them."""
    from deepinfer.hal import get_backend

    fp8_k128 = _kernel_module()
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([40, 0, 129, 300, 17, 64, 0])
    n, k = 256, 1024
    xq = quantize(torch.randn(int(sizes.sum()), k, generator=g), "fp8")
    wq = quantize(torch.randn(len(sizes), n, k, generator=g) * k ** -0.5, w_format)
    expected = get_backend("reference").implementations()["grouped_gemm"](xq, wq, sizes)
    on_gpu = [Quantized(q.data.cuda(), q.scale.cuda(), q.fmt, q.block) for q in (xq, wq)]
    native = get_backend("sm100", {"quant_gemm": "native"}).implementations()["grouped_gemm"](
        *on_gpu, sizes.cuda(), out_dtype=out_dtype)
    x, x_scale = fp8_scales.aligned(xq)
    w, w_scale = fp8_scales.aligned(wq, group=None)
    tiles = {"out_dtype": "bfloat16"} if out_dtype == torch.bfloat16 else {}
    kernel = fp8_k128.run(*(t.cuda() for t in (x, x_scale, w, w_scale, sizes)), **tiles)
    assert native.dtype == (out_dtype or torch.float32) and torch.equal(native, kernel)
    rounding = expected.abs() * 2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0
    assert ((native.cpu().float() - expected).abs() - rounding).max() <= 2 ** -9 * expected.abs().max()
    exact = get_backend("sm100").implementations()["grouped_gemm"](*on_gpu, sizes.cuda(), out_dtype=out_dtype).cpu()
    reference = get_backend("reference").implementations()["grouped_gemm"](xq, wq, sizes, out_dtype=out_dtype)
    assert exact.dtype == reference.dtype
    assert ((exact.float() - expected).abs() - rounding).max() <= 2 ** -16 * expected.abs().max()
