import numpy as np
import pytest
import torch

from deepinfer.hal.formats import Quantized, dequantize, quantize
from deepinfer.hal.ops.grouped_gemm import grouped_gemm, linear
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle

E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BYTE_TO_E2M1_PAIR = np.stack((E2M1_TABLE[np.arange(256) & 0xF], E2M1_TABLE[np.arange(256) >> 4]), axis=-1)


def e4m3_bits_to_float64(bits: np.ndarray) -> np.ndarray:
    """e4m3fn from its bit fields: sign, 4-bit exponent (bias 7, subnormals at 0), 3-bit mantissa."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8 * 2.0 ** -6
    return sign * np.where(exponent == 0, subnormal, normal)


E4M3_TABLE = e4m3_bits_to_float64(np.arange(256))


def float64_values(operand) -> torch.Tensor:
    """Decode an operand to float64 without formats.dequantize (bit fields and a code table)."""
    if not isinstance(operand, Quantized):
        return operand.double()
    data = operand.data.view(torch.uint8).numpy()
    elements = (E4M3_TABLE if operand.fmt == "fp8" else BYTE_TO_E2M1_PAIR)[data]
    scales = np.exp2(operand.scale.numpy().astype(np.float64) - 127.0)
    blocks = elements.reshape(*scales.shape, operand.block) * scales[..., None]
    return torch.from_numpy(blocks.reshape(*scales.shape[:-1], -1))


def linear_float64(x, weight, out_dtype=None):
    """numpy tensordot over K, in float64 (which ``out_dtype`` float32 must match to float32's tolerance)."""
    out = np.tensordot(float64_values(x).numpy(), float64_values(weight).numpy(), axes=([-1], [1]))
    return torch.from_numpy(out)


def output_features(weight):
    return (weight.data if isinstance(weight, Quantized) else weight).shape[1]


def expert_slice(weight, expert):
    if isinstance(weight, Quantized):
        return Quantized(weight.data[expert], weight.scale[expert], weight.fmt, weight.block)
    return weight[expert]


def grouped_gemm_float64(x, weight, group_sizes, out_dtype=None):
    """Loop over experts; each segment's rows times that expert's transposed weight (in float64
    whatever ``out_dtype``: the comparison rounds it as the op's result is)."""
    xs = float64_values(x)
    out = torch.zeros(xs.shape[0], output_features(weight), dtype=torch.float64)
    first_row = 0
    for expert, size in enumerate(group_sizes.tolist()):
        if size:
            segment = slice(first_row, first_row + size)
            out[segment] = torch.mm(xs[segment], float64_values(expert_slice(weight, expert)).t())
            first_row += size
    return out


@pytest.mark.parametrize("case", [c.name for c in SPECS["linear"].cases])
def test_linear_matches_float64(case):
    check_against_oracle("linear", case, linear_float64)


@pytest.mark.parametrize("case", [c.name for c in SPECS["grouped_gemm"].cases])
def test_grouped_gemm_matches_float64(case):
    check_against_oracle("grouped_gemm", case, grouped_gemm_float64)


def test_grouped_gemm_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    weight = torch.tensor([[[1.0, 1.0], [1.0, -1.0]], [[2.0, 0.0], [0.0, 0.5]], [[9.0, 9.0], [9.0, 9.0]]])
    y = grouped_gemm(x, weight, torch.tensor([1, 2, 0]))
    assert torch.equal(y, torch.tensor([[3.0, -1.0], [6.0, 2.0], [10.0, 3.0]]))


def test_e4m3_decoding_matches_formats_exactly():
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    data = torch.tensor(finite, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, -1)[:, :224]
    q = Quantized(data, torch.tensor([[100, 127, 130, 140, 120, 127, 127]], dtype=torch.uint8), "fp8")
    assert torch.equal(dequantize(q).double(), float64_values(q))


def test_mxfp4_decoding_matches_formats_exactly():
    data = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    scale = torch.tensor([[127, 120, 1, 250], [130, 127, 127, 127], [118, 135, 100, 127], [127, 127, 126, 128]],
                         dtype=torch.uint8)
    q = Quantized(data, scale, "mxfp4")
    assert torch.equal(dequantize(q).double(), float64_values(q))


def test_quantized_operands_are_dequantized_exactly(gen):
    x = quantize(torch.randn(6, 64, generator=gen), "fp8")
    w8 = quantize(torch.randn(3, 8, 64, generator=gen), "fp8")
    w4 = quantize(torch.randn(3, 8, 64, generator=gen), "mxfp4")
    sizes = torch.tensor([2, 0, 4])
    for weight in (w8, w4):
        got = grouped_gemm(x, weight, sizes)
        assert got.dtype == torch.float32
        assert torch.equal(got, grouped_gemm(dequantize(x), dequantize(weight), sizes))
        flat = Quantized(weight.data[2], weight.scale[2], weight.fmt)
        assert torch.equal(linear(x, flat), linear(dequantize(x), dequantize(flat)))


def test_plain_operands_keep_x_dtype(gen):
    x = torch.randn(4, 32, generator=gen).bfloat16()
    weight = torch.randn(2, 8, 32, generator=gen).bfloat16()
    assert grouped_gemm(x, weight, torch.tensor([1, 3])).dtype == torch.bfloat16
    assert linear(x, weight[0]).dtype == torch.bfloat16


def test_rows_after_the_segments_are_not_computed():
    """Group sizes may sum to fewer rows than x holds (one rank's unrouted slots): those rows stay
    zero and the segments are what a per-expert float64 product gives."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(7, 32, generator=gen), torch.randn(3, 8, 32, generator=gen)
    y = grouped_gemm(x, weight, torch.tensor([2, 0, 3]))
    want = torch.cat((x[:2].double() @ weight[0].double().T, x[2:5].double() @ weight[2].double().T))
    torch.testing.assert_close(y[:5].double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[5:], torch.zeros(2, 8))


@pytest.mark.parametrize("sizes, match", [
    ([3, 2], "sum to at most the 4 rows"),
    ([5, -1], "non-negative"),
    ([1, 1, 2], r"int64 \[2\]"),
])
def test_grouped_gemm_rejects_bad_group_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        grouped_gemm(torch.zeros(4, 32), torch.zeros(2, 8, 32), torch.tensor(sizes))


def test_bf16_out_is_the_float32_result_rounded_once():
    g = torch.Generator().manual_seed(7)
    x = quantize(torch.randn(9, 64, generator=g), "fp8")
    weight = quantize(torch.randn(3, 24, 64, generator=g), "mxfp4")
    sizes = torch.tensor([4, 0, 5])
    y = grouped_gemm(x, weight, sizes, out_dtype=torch.bfloat16)
    want = grouped_gemm_float64(x, weight, sizes)
    assert y.dtype == torch.bfloat16
    # round to nearest: within half a bf16 ulp (2^-8 of the value) of the float64 product, and float32's summation
    assert ((y.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
    assert torch.equal(y, grouped_gemm(x, weight, sizes, out_dtype=torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("x_dtype, out_dtype", [(None, torch.float16), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_grouped_gemm_rejects_out_dtypes_it_does_not_write(x_dtype, out_dtype):
    x = quantize(torch.zeros(4, 32), "fp8") if x_dtype is None else torch.zeros(4, 32, dtype=x_dtype)
    weight = torch.zeros(2, 8, 32, dtype=x_dtype or torch.float32)
    with pytest.raises(ValueError, match="out_dtype must be None or one of"):
        grouped_gemm(x, weight, torch.tensor([2, 2]), out_dtype=out_dtype)


def test_grouped_gemm_rejects_int32_group_sizes():
    with pytest.raises(ValueError, match="group_sizes must be int64"):
        grouped_gemm(torch.zeros(4, 32), torch.zeros(2, 8, 32), torch.tensor([2, 2], dtype=torch.int32))


def test_rejects_mismatched_k_and_bad_layouts():
    with pytest.raises(ValueError, match=r"weight \(2, 8, 64\)"):
        grouped_gemm(torch.zeros(4, 32), torch.zeros(2, 8, 64), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="x is Quantized 'mxfp4'"):
        linear(quantize(torch.zeros(2, 32), "mxfp4"), torch.zeros(8, 32))
    bad_scale = Quantized(torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match=r"scale \(8, 2\).*expected.*\(8, 1\)"):
        linear(torch.zeros(2, 32), bad_scale)
