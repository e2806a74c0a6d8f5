"""The clamped SwiGLU against a float64 computation on every case."""
import math

import pytest
import torch

from deepinfer.hal.ops.activation import swiglu
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import _clone


def swiglu_float64(gate, up, limit, dtype=None):
    g, u = gate.double(), up.double()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("case", [c.name for c in SPECS["swiglu"].cases])
def test_swiglu_matches_float64(case):
    spec = SPECS["swiglu"]
    inputs = spec.case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    got = swiglu(**_clone(inputs))
    assert got.dtype == (inputs["dtype"] or inputs["gate"].dtype)
    want = swiglu_float64(**inputs)
    tol = spec.tolerance(got.dtype)
    torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)


def test_the_limit_clamps_gate_from_above_and_up_both_ways():
    gate = torch.tensor([20.0, -20.0, 1.0])
    up = torch.tensor([-30.0, 5.0, 30.0])
    got = swiglu(gate, up, 10.0)
    silu = [10 / (1 + math.exp(-10)), -20 / (1 + math.exp(20)), 1 / (1 + math.exp(-1))]
    torch.testing.assert_close(got, torch.tensor([silu[0] * -10, silu[1] * 5, silu[2] * 10]))


def test_mismatched_shapes_and_a_non_positive_limit_are_refused():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.zeros(2, 3), torch.zeros(3, 2), 1.0)
    with pytest.raises(ValueError, match="positive"):
        swiglu(torch.zeros(2), torch.zeros(2), 0.0)
