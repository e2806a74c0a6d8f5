import pytest

from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def rms_norm_float64(x, weight, eps, residual=None):
    """Row by row, from the definition: x / sqrt(mean(x^2) + eps) * w."""
    summed = x if residual is None else x + residual
    rows = summed.reshape(-1, summed.shape[-1])
    out = rows.clone()
    for i, row in enumerate(rows):
        out[i] = row / (row.pow(2).sum() / row.numel() + eps).sqrt() * weight
    out = out.reshape(summed.shape)
    return out if residual is None else (out, summed)


@pytest.mark.parametrize("case", [c.name for c in SPECS["rms_norm"].cases])
def test_rms_norm_matches_float64(case):
    check_against_oracle("rms_norm", case, rms_norm_float64)
