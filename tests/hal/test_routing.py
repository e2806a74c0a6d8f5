import math

import pytest
import torch

from deepinfer.hal.ops.routing import moe_gate
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def moe_gate_float64(logits, bias, top_k, routed_scale):
    """Token by token in Python floats: sort (value desc, id asc), keep k, renormalize."""
    all_weights, all_ids = [], []
    for row in logits.tolist():
        scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        values = scores if bias is None else [s + b for s, b in zip(scores, bias.tolist())]
        ids = sorted(range(len(row)), key=lambda e: (-values[e], e))[:top_k]
        total = sum(scores[e] for e in ids) + 1e-20
        all_weights.append([scores[e] / total * routed_scale for e in ids])
        all_ids.append(ids)
    return torch.tensor(all_weights, dtype=torch.float64), torch.tensor(all_ids)


@pytest.mark.parametrize("case", [c.name for c in SPECS["moe_gate"].cases])
def test_moe_gate_matches_float64(case):
    check_against_oracle("moe_gate", case, moe_gate_float64)


def test_bias_steers_selection_but_not_weights_by_hand():
    # softplus of these logits is 1, 4, 9 and 0.25, so the scores are 1, 2, 3 and 0.5
    logits = torch.tensor([[math.log(math.e - 1), math.log(math.e ** 4 - 1),
                            math.log(math.e ** 9 - 1), math.log(math.e ** 0.25 - 1)]])
    bias = torch.tensor([0.0, 0.0, -2.5, 2.0])  # selection values 1, 2, 0.5, 2.5
    weights, ids = moe_gate(logits, bias, top_k=2, routed_scale=1.5)
    assert ids.tolist() == [[3, 1]]
    assert torch.allclose(weights, torch.tensor([[0.5 / 2.5 * 1.5, 2.0 / 2.5 * 1.5]]), atol=1e-6, rtol=0)
    assert moe_gate(logits, None, top_k=2, routed_scale=1.5)[1].tolist() == [[2, 1]]


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = moe_gate(logits, None, top_k=3, routed_scale=1.0)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))


def test_output_dtypes():
    weights, ids = moe_gate(torch.randn(3, 16).bfloat16(), torch.zeros(16), 4, 2.5)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.allclose(weights.sum(dim=-1), torch.full((3,), 2.5))


@pytest.mark.parametrize("kwargs, match", [
    ({"logits": torch.zeros(8)}, "logits must be a float \\[T, E\\]"),
    ({"bias": torch.zeros(7)}, "bias must have shape \\[E=8\\]"),
    ({"top_k": 0}, "top_k must lie in \\[1, E=8\\], got 0"),
    ({"top_k": 9}, "top_k must lie in \\[1, E=8\\], got 9"),
])
def test_bad_arguments_are_rejected(kwargs, match):
    args = {"logits": torch.zeros(2, 8), "bias": torch.zeros(8), "top_k": 2, "routed_scale": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        moe_gate(**args)
