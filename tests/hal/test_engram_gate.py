import math

import pytest
import torch

from deepinfer.hal.ops.engram_gate import CLAMP, engram_gate
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def engram_gate_float64(residual, kv, weight_hidden, weight_embed, eps, clamp=CLAMP):
    """Stream by stream, from the definition: x_m + sigmoid(ssqrt(<rms(x_m) wh_m, rms(k_m) we_m> / sqrt(H))) v."""
    out = residual.clone()
    tokens, streams, hidden = residual.shape
    for t in range(tokens):
        value = kv[t, streams]
        for m in range(streams):
            x, k = residual[t, m], kv[t, m]
            normed_x = x / (x.pow(2).sum() / hidden + eps).sqrt() * weight_hidden[m]
            normed_k = k / (k.pow(2).sum() / hidden + eps).sqrt() * weight_embed[m]
            score = float((normed_x * normed_k).sum()) / math.sqrt(hidden)
            root = math.copysign(math.sqrt(max(abs(score), clamp)), score) if score else 0.0
            out[t, m] = x + value / (1.0 + math.exp(-root))
    return out


@pytest.mark.parametrize("case", [c.name for c in SPECS["engram_gate"].cases if c.size == "tiny"])
def test_engram_gate_matches_float64(case):
    check_against_oracle("engram_gate", case, engram_gate_float64)


def test_the_clamp_bounds_the_root_of_small_scores():
    """A score below the clamp takes the clamp's root, with the score's sign; a zero score gates 1/2."""
    hidden = 4
    residual = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]])
    kv = torch.zeros(1, 3, hidden)
    kv[0, 0, 0], kv[0, 0, 1] = 1.0, 1.0  # with weight_embed 1e-9: a positive score near 1.4e-9
    kv[0, 2] = torch.tensor([0.0, 0.0, 0.0, 8.0])
    weight_hidden = torch.ones(2, hidden)
    weight_embed = torch.full((2, hidden), 1e-9)
    out = engram_gate(residual, kv, weight_hidden, weight_embed, eps=1e-6)
    assert out[0, 0, 3].item() == pytest.approx(8.0 / (1.0 + math.exp(-math.sqrt(CLAMP))), rel=1e-6)
    assert out[0, 1, 3].item() == pytest.approx(4.0)  # key 1 is zero: its score is 0, its gate 1/2


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match=r"kv must be \[3, 5, 8\]"):
        engram_gate(torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), torch.ones(4, 8), torch.ones(4, 8), 1e-6)
