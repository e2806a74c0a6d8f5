import pytest
import torch

from deepinfer.hal.formats import quantize
from deepinfer.hal.ops.grouped_gemm import grouped_gemm
from deepinfer.hal.ops.grouped_linear import grouped_linear
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle
from tests.hal.test_grouped_gemm import float64_values


def grouped_linear_float64(x, weight, positions=None, cos_sin=None, rope_head=0, conjugate=False,
                           rope_in_place=False):
    """Token by token, group by group, in float64 from the operands' decoded values; with
    ``rope_head``, each head's trailing pairs of ``x`` turned by hand first (``rope_in_place``
    changes nothing in the result)."""
    xv, wv = float64_values(x), float64_values(weight)
    if rope_head:
        xv, half = xv.clone().reshape(xv.shape[0], -1), cos_sin.shape[1] // 2
        sign = -1.0 if conjugate else 1.0
        for t, p in enumerate(positions.tolist()):
            for first in range(rope_head - 2 * half, xv.shape[1], rope_head):
                for i in range(half):
                    c, s = float(cos_sin[p, i]), sign * float(cos_sin[p, half + i])
                    a, b = float(xv[t, first + 2 * i]), float(xv[t, first + 2 * i + 1])
                    xv[t, first + 2 * i], xv[t, first + 2 * i + 1] = a * c - b * s, a * s + b * c
        xv = xv.reshape(x.shape)
    out = torch.zeros(xv.shape[0], xv.shape[1], wv.shape[1], dtype=torch.float64)
    for t in range(xv.shape[0]):
        for g in range(xv.shape[1]):
            out[t, g] = wv[g] @ xv[t, g]
    return out


@pytest.mark.parametrize("case", [c.name for c in SPECS["grouped_linear"].cases])
def test_grouped_linear_matches_float64(case):
    check_against_oracle("grouped_linear", case, grouped_linear_float64)


def test_two_groups_by_hand():
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])  # one token, two groups of K=2
    weight = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [[2.0, 0.0], [0.0, -1.0], [0.0, 0.0]]])
    assert grouped_linear(x, weight).tolist() == [[[1.0, 2.0, 3.0], [6.0, -4.0, 0.0]]]


def test_equals_the_grouped_gemm_on_group_major_rows_bitwise():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 4, 64, generator=gen).bfloat16()
    weight = quantize(torch.randn(4, 24, 64, generator=gen) / 8, "fp8", 32)
    rows = x.transpose(0, 1).reshape(28, 64)
    want = grouped_gemm(rows, weight, torch.full((4,), 7, dtype=torch.int64)).view(4, 7, 24).transpose(0, 1)
    got = grouped_linear(x, weight)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("x_shape,w_shape", [((3, 2, 64), (3, 16, 64)), ((3, 2, 64), (2, 16, 32)), ((6, 64), (2, 16, 64))])
def test_mismatched_shapes_are_refused(x_shape, w_shape):
    with pytest.raises(ValueError, match=r"grouped_linear expects x \[T, G, K\] and weight \[G, N, K\]"):
        grouped_linear(torch.zeros(x_shape), torch.zeros(w_shape))


def test_rope_head_turns_each_heads_tail_back_before_the_product_by_hand():
    """One token, one group of two 4-wide heads, R=2 at a quarter turn: conjugate RoPE takes
    (a, b) to (b, -a) in columns (2, 3) and (6, 7); the identity weight shows the turned input."""
    x = torch.arange(1.0, 9.0).view(1, 1, 8)
    cos_sin = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    got = grouped_linear(x, torch.eye(8).view(1, 8, 8), torch.tensor([1]), cos_sin, rope_head=4, conjugate=True)
    assert got.flatten().tolist() == [1.0, 2.0, 4.0, -3.0, 5.0, 6.0, 8.0, -7.0]
    assert x.flatten().tolist() == list(range(1, 9))  # without rope_in_place the input is untouched
    with pytest.raises(ValueError, match="must divide K"):
        grouped_linear(x, torch.eye(8).view(1, 8, 8), torch.tensor([1]), cos_sin, rope_head=3)
    with pytest.raises(ValueError, match="go with rope_head"):
        grouped_linear(x, torch.eye(8).view(1, 8, 8), torch.tensor([1]), cos_sin)


def test_rope_in_place_turns_the_heads_where_they_lie_by_hand():
    """As above with ``rope_in_place``: the same product, and the heads of a contiguous ``x``
    turned in ``x`` itself; an ``x`` whose heads cannot be viewed is turned in a copy."""
    cos_sin = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    x = torch.arange(1.0, 9.0).view(1, 1, 8)
    got = grouped_linear(x, torch.eye(8).view(1, 8, 8), torch.tensor([1]), cos_sin, rope_head=4, conjugate=True,
                         rope_in_place=True)
    assert got.flatten().tolist() == [1.0, 2.0, 4.0, -3.0, 5.0, 6.0, 8.0, -7.0]
    assert x.flatten().tolist() == [1.0, 2.0, 4.0, -3.0, 5.0, 6.0, 8.0, -7.0]
    strided = torch.arange(1.0, 17.0).view(1, 8, 2).transpose(1, 2)  # groups and heads cannot merge in a view
    got = grouped_linear(strided, torch.eye(8).expand(2, 8, 8), torch.tensor([1]), cos_sin, rope_head=4,
                         conjugate=True, rope_in_place=True)
    assert got.tolist() == [[[1.0, 3.0, 7.0, -5.0, 9.0, 11.0, 15.0, -13.0],
                             [2.0, 4.0, 8.0, -6.0, 10.0, 12.0, 16.0, -14.0]]]
