"""The experimental native-FP8 grouped GEMM with scales per 128 along K
(``kernels/experimental/grouped_gemm_fp8_k128.py``): the alignment of per-32 operands on the CPU
(hand-worked bytes, MXFP4 exactness, the error bound), its compile for sm_90a, and on a GPU
(skipped without one) the kernel against float64 on its own operands and, fed aligned HAL operands,
against the reference backend's grouped GEMM."""
import pytest
import torch

from deepinfer.hal.formats import Quantized, dequantize, quantize

pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
from deepinfer_backends.sm100.kernels.experimental import grouped_gemm_fp8_k128 as fp8_k128  # noqa: E402


def _fp8_rows(values: list[float], scale_bytes: list[int]) -> Quantized:
    data = torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn).reshape(1, -1)
    return Quantized(data, torch.tensor([scale_bytes], dtype=torch.uint8), "fp8", 32)


def test_alignment_shifts_each_block_to_the_groups_largest_scale():
    # four blocks of 32 with scale exponents 0, -1, -2 and -6 (bytes 127, 126, 125, 121): the group
    # keeps 2^0; block b's values are multiplied by 2^-{0, 1, 2, 6} and rounded to e4m3
    values = [3.0] * 32 + [1.75] * 32 + [448.0] * 32 + [0.01953125] * 32  # 0.01953125 = 1.25 * 2^-6
    q = _fp8_rows(values, [127, 126, 125, 121])
    data, scale = fp8_k128.aligned(q)
    assert scale.tolist() == [[1.0]]
    got = data.float()[0].reshape(4, 32)[:, 0].tolist()
    # 1.25 * 2^-12 is below e4m3's smallest subnormal step 2^-9: it rounds to 0 (0.3125 steps)
    assert got == [3.0, 0.875, 112.0, 0.0]


def test_alignment_rounds_subnormals_to_nearest_even():
    # a block one binade below its group: 1.125 * 2^-6 becomes 1.125 * 2^-7 = 4.5 * 2^-9, which
    # ties to the even 4 * 2^-9; 1.375 * 2^-6 becomes 5.5 * 2^-9 and goes to 6 * 2^-9
    q = _fp8_rows([1.0] * 32 + [1.125 * 2 ** -6] * 16 + [1.375 * 2 ** -6] * 16 + [1.0] * 64, [130, 129, 130, 129])
    data, scale = fp8_k128.aligned(q)
    assert scale.tolist() == [[8.0]]
    column = data.float()[0]
    assert column[32].item() == 4 * 2 ** -9 and column[48].item() == 6 * 2 ** -9
    assert column[0].item() == 1.0 and column[96].item() == 0.5


def test_zero_scale_byte_reads_as_a_zero_block():
    q = _fp8_rows([2.0] * 128, [0, 127, 127, 127])
    data, scale = fp8_k128.aligned(q)
    assert data.float()[0, :32].abs().sum().item() == 0 and data.float()[0, 32:].eq(2.0).all()


def test_mxfp4_weights_align_exactly_when_scales_span_fourteen_binades():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 512, generator=g)
    w = w * torch.exp2(torch.randint(-7, 7, (3, 8, 16), generator=g).float()).repeat_interleave(32, -1)
    q = quantize(w, "mxfp4")
    exponents = q.scale.int().unflatten(-1, (-1, 4))
    assert (exponents.amax(-1) - exponents.amin(-1)).max() == 14  # the widest span kept exact
    data, scale = fp8_k128.aligned(q)
    restored = data.double() * scale.double().repeat_interleave(128, -1)
    assert torch.equal(restored, dequantize(q).double())


def test_fp8_alignment_error_is_bounded_by_the_subnormal_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1024, generator=g) * torch.exp2(torch.randint(-4, 5, (64, 32), generator=g).float()
                                                         ).repeat_interleave(32, -1)
    q = quantize(x, "fp8")
    data, scale = fp8_k128.aligned(q)
    restored = data.double() * scale.double().repeat_interleave(128, -1)
    exact = dequantize(q).double()
    # a shifted value stays exact in e4m3's normal range, else it moves by at most half of 2^-9 of its scale
    bound = 2.0 ** -10 * scale.double().repeat_interleave(128, -1)
    assert ((restored - exact).abs() <= bound).all()
    assert (restored == exact).double().mean() > 0.99


def test_kernel_compiles_for_hopper():
    import shutil

    from deepinfer_backends.sm100.launch import compile_kernel

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    kernel = compile_kernel(fp8_k128.MODULE, "grouped_gemm_fp8_k128", (4, 384, 640), {}, "sm_90a")
    assert kernel is not None


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_kernel_matches_float64_on_its_operands():
    kernel = fp8_k128

    g = torch.Generator().manual_seed(2)
    sizes = torch.tensor([0, 130, 1, 255, 64, 0, 300])
    n, k = 384, 640
    x = torch.randn(int(sizes.sum()), k, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(len(sizes), n, k, generator=g).to(torch.float8_e4m3fn)
    x_scale = torch.exp2(torch.randint(-6, 2, (x.shape[0], k // 128), generator=g).float())
    w_scale = torch.exp2(torch.randint(-6, 2, (len(sizes), n, k // 128), generator=g).float())
    args = [t.cuda() for t in (x, x_scale, w, w_scale, sizes)]
    y = kernel.run(*args)
    expected = kernel.reference(*args)
    # the tensor cores accumulate a k-block's e4m3 products in fewer bits than float32 has
    assert (y - expected).abs().max() <= 2 ** -10 * expected.abs().max()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("w_format", ["fp8", "mxfp4"])
def test_aligned_operands_match_the_reference_backend_within_the_alignment(w_format):
    from deepinfer.hal import get_backend

    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([40, 0, 129, 300, 17, 64])
    n, k = 256, 1024
    xq = quantize(torch.randn(int(sizes.sum()), k, generator=g), "fp8")
    wq = quantize(torch.randn(len(sizes), n, k, generator=g) * k ** -0.5, w_format)
    x, x_scale = fp8_k128.aligned(xq)
    w, w_scale = fp8_k128.aligned(wq)
    y = fp8_k128.run(*(t.cuda() for t in (x, x_scale, w, w_scale, sizes))).cpu()
    expected = get_backend("reference").implementations()["grouped_gemm"](xq, wq, sizes)
    # the exact numbers, moved by the activations' alignment and the tensor cores' FP8 accumulation
    assert (y - expected).abs().max() <= 2 ** -9 * expected.abs().max()
