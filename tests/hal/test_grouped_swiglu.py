import math

import pytest
import torch

from deepinfer.hal.formats import quantize
from deepinfer.hal.ops.grouped_swiglu import grouped_swiglu
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle
from tests.hal.test_grouped_gemm import float64_values


def grouped_swiglu_float64(x, w1, w3, group_sizes, limit, dtype=None):
    """Row by row in float64 from the operands' decoded values: each row's segment's weights."""
    xv, gate_w, up_w = float64_values(x), float64_values(w1), float64_values(w3)
    out = torch.zeros(xv.shape[0], gate_w.shape[1], dtype=torch.float64)
    row = 0
    for expert, size in enumerate(group_sizes.tolist()):
        for r in range(row, row + size):
            gate, up = gate_w[expert] @ xv[r], up_w[expert] @ xv[r]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[r] = gate / (1 + torch.exp(-gate)) * up
        row += size
    return out


@pytest.mark.parametrize("case", [c.name for c in SPECS["grouped_swiglu"].cases if c.size != "real"])
def test_grouped_swiglu_matches_float64(case):
    check_against_oracle("grouped_swiglu", case, grouped_swiglu_float64)


def test_one_row_by_hand():
    x = torch.tensor([[1.0, 2.0]])
    w1 = torch.tensor([[[1.0, 0.0], [0.0, 5.0]]])  # gate: 1, 10 -> clamped to 3
    w3 = torch.tensor([[[0.0, 1.0], [-4.0, 0.0]]])  # up: 2, -4 -> clamped to -3
    got = grouped_swiglu(x, w1, w3, torch.tensor([1]), limit=3.0)
    silu = [v / (1 + math.exp(-v)) for v in (1.0, 3.0)]
    assert got[0].tolist() == pytest.approx([silu[0] * 2.0, silu[1] * -3.0], rel=1e-6)


def test_quantized_weights_give_float32_unless_a_dtype_is_asked_for():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    w1, w3 = (quantize(torch.randn(2, 8, 64, generator=gen) / 8, "fp8", 32) for _ in range(2))
    sizes = torch.tensor([1, 2])
    assert grouped_swiglu(x, w1, w3, sizes, 7.0).dtype == torch.float32
    assert grouped_swiglu(x, w1, w3, sizes, 7.0, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("w3, limit, message", [
    (torch.zeros(2, 8, 32), 7.0, "same shape and format"),
    (torch.zeros(2, 4, 32).bfloat16(), 7.0, "same shape and format"),
    (torch.zeros(2, 4, 32), 0.0, "limit must be positive"),
])
def test_bad_arguments_are_refused(w3, limit, message):
    with pytest.raises(ValueError, match=message):
        grouped_swiglu(torch.zeros(3, 32), torch.zeros(2, 4, 32), w3, torch.tensor([1, 2]), limit)
