import pytest
import torch

from deepinfer.hal.formats import quantize
from deepinfer.hal.ops.stacked_linear import stacked_linear
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle
from tests.hal.test_grouped_gemm import float64_values


def stacked_linear_float64(x, weights):
    """Each product element by element in float64 from the operands' decoded values."""
    xv = float64_values(x).reshape(-1, x.shape[-1])
    outs = []
    for weight in weights:
        wv = float64_values(weight)
        out = torch.tensor([[sum(float(a) * float(b) for a, b in zip(row, column)) for column in wv] for row in xv],
                           dtype=torch.float64) if xv.shape[0] * wv.shape[0] <= 4096 else xv @ wv.T
        outs.append(out.reshape(*x.shape[:-1], wv.shape[0]))
    return tuple(outs)


@pytest.mark.parametrize("case", [c.name for c in SPECS["stacked_linear"].cases if c.size != "real"])
def test_stacked_linear_matches_float64(case):
    check_against_oracle("stacked_linear", case, stacked_linear_float64)


def test_two_weights_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    first, second = stacked_linear(x, [torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 2.0], [-1.0, 0.5]])])
    assert first.tolist() == [[3.0], [2.0]]
    assert second.tolist() == [[4.0, 0.0], [-2.0, -3.5]]


def test_each_product_has_linears_dtype():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    plain, quantized = stacked_linear(x, [torch.randn(16, 64, generator=gen).bfloat16(),
                                          quantize(torch.randn(8, 64, generator=gen) / 8, "fp8", 32)])
    assert (plain.dtype, quantized.dtype) == (torch.bfloat16, torch.float32)
    assert plain.is_contiguous() and quantized.shape == (3, 8)


@pytest.mark.parametrize("weights, message", [
    ([], "non-empty sequence"),
    (torch.zeros(4, 8), "non-empty sequence"),
    ([torch.zeros(4, 8), torch.zeros(4, 6)], r"weights\[1\] \(4, 6\)"),
    ([torch.zeros(2, 4, 8)], r"weights\[0\] \(2, 4, 8\)"),
])
def test_bad_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        stacked_linear(torch.zeros(3, 8), weights)
