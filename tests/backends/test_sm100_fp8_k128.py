"""The sm100 native-FP8 grouped GEMM with scales per 128 along K (``backend.options.fp8_grouped_gemm=native_k128``):
the alignment of per-32 operands on the CPU (hand-worked bytes, MXFP4 exactness), the option's refusal,
and on a GPU (skipped without one) the kernel against float64 on its own operands and the op against the
reference backend on ragged expert segments."""
import pytest
import torch

from deepinfer.hal.formats import Quantized, dequantize, quantize

pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
from deepinfer_backends.sm100 import fp8_k128  # noqa: E402
from deepinfer_backends.sm100.options import KernelOptions  # noqa: E402


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


def test_unknown_choice_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="fp8_grouped_gemm='fast'.*exact.*native_k128"):
        KernelOptions(fp8_grouped_gemm="fast")


def test_kernel_compiles_for_hopper_with_the_served_tiles():
    import shutil

    from deepinfer_backends.sm100.launch import compile_kernel

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    kernel = compile_kernel("grouped_gemm_fp8_k128", "grouped_gemm_fp8_k128", (4, 384, 640), fp8_k128.TILES, "sm_90a")
    assert kernel is not None


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_kernel_matches_float64_on_its_operands():
    from deepinfer_backends.sm100.kernels import grouped_gemm_fp8_k128 as kernel

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
@pytest.mark.parametrize("x_format,w_format", [("fp8", "fp8"), ("fp8", "mxfp4"), ("bf16", "mxfp4")])
def test_op_matches_the_reference_backend_within_fp8_rounding(x_format, w_format):
    from deepinfer.hal import get_backend

    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([40, 0, 129, 300, 17, 64])
    n, k = 256, 1024
    x = torch.randn(int(sizes.sum()), k, generator=g)
    w = torch.randn(len(sizes), n, k, generator=g) * k ** -0.5
    xq = quantize(x, "fp8") if x_format == "fp8" else x.bfloat16()
    wq = quantize(w, w_format)
    to_cuda = (lambda q: Quantized(q.data.cuda(), q.scale.cuda(), q.fmt, q.block) if isinstance(q, Quantized)
               else q.cuda())
    native = get_backend("sm100", {"fp8_grouped_gemm": "native_k128"}).implementations()["grouped_gemm"]
    y = native(to_cuda(xq), to_cuda(wq), sizes.cuda()).cpu()
    expected = get_backend("reference").implementations()["grouped_gemm"](xq, wq, sizes)
    # the exact path's numbers, moved by the operands' alignment (and, for bf16 x, by its cast to
    # e4m3, whose 3 mantissa bits leave each activation up to 2^-4 off)
    tolerance = 2 ** -4 if x_format == "bf16" else 2 ** -9
    assert y.dtype == torch.float32
    assert (y - expected).abs().max() <= tolerance * expected.abs().max()


ALIGN_CHECK = """
import sys
import torch
from deepinfer.hal.formats import quantize
from deepinfer_backends.sm100 import fp8_k128
from deepinfer_backends.sm100.fused.fp8_k128_align import align_rows

device = sys.argv[1]
g = torch.Generator().manual_seed(4)
x = torch.randn(19, 512, generator=g) * torch.exp2(torch.randint(-5, 6, (19, 16), generator=g).float()
                                                    ).repeat_interleave(32, -1)
x[3, :40] = 0.0
q = quantize(x, "fp8")
q.scale[5, 2] = 0
for args, want in (((q.data, q.scale), fp8_k128.aligned(q)),
                   ((x.bfloat16(), None), fp8_k128.aligned(quantize(x.bfloat16(), "fp8")))):
    data, scale = align_rows(*(a.to(device) if a is not None else None for a in args))
    assert torch.equal(data.cpu().view(torch.uint8), want[0].view(torch.uint8)), "bytes differ"
    assert torch.equal(scale.cpu(), want[1].T), "scales differ"
print("ok")
"""


def test_triton_alignment_matches_the_torch_model_bit_for_bit():
    """On a GPU the kernel itself; on the CPU Triton's interpreter runs it (a subprocess)."""
    import subprocess
    import sys

    from tests.backends.test_sm100_fused import interpreted

    if torch.cuda.is_available():
        done = subprocess.run([sys.executable, "-c", ALIGN_CHECK, "cuda"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "ok"
    else:
        assert interpreted(ALIGN_CHECK, "cpu").strip() == "ok"
