"""mHC's Sinkhorn as DeepInfer runs it (issue 29): softmax plus eps, the columns once, then
(iters - 1) times the rows and the columns, so the matrix ends column-normalised. Values worked
out by hand with exact fractions (eps 0)."""
import json
import math
from pathlib import Path

import pytest
import torch

from deepinfer.hal.ops.mhc import sinkhorn

# softmax rows [1/4, 3/4] and [1/2, 1/2]
LOGITS = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)


def test_one_iteration_is_one_column_pass():
    """Column sums 3/4 and 5/4: [[1/3, 3/5], [2/3, 2/5]]; the rows sum to 14/15 and 16/15."""
    got = sinkhorn(LOGITS, 0.0, 1)
    assert torch.allclose(got.double(), torch.tensor([[1 / 3, 3 / 5], [2 / 3, 2 / 5]], dtype=torch.float64),
                          rtol=1e-6)


def test_two_iterations_are_columns_rows_columns():
    """After the columns, rows of 14/15 and 16/15 give [[5/14, 9/14], [5/8, 3/8]]; then column
    sums 55/56 and 57/56 give [[4/11, 12/19], [7/11, 7/19]], whose columns sum to 1."""
    got = sinkhorn(LOGITS, 0.0, 2).double()
    want = torch.tensor([[4 / 11, 12 / 19], [7 / 11, 7 / 19]], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-6)
    assert torch.allclose(got.sum(dim=0), torch.ones(2, dtype=torch.float64), rtol=1e-6)
    assert not torch.allclose(got.sum(dim=1), torch.ones(2, dtype=torch.float64), rtol=1e-3)


def test_eps_is_added_to_the_softmax_and_to_every_sum():
    """eps 0.5 on one 1x1 logit: softmax 1, plus eps 1.5; one column pass: 1.5 / (1.5 + 0.5)."""
    assert sinkhorn(torch.zeros(1, 1), 0.5, 1).item() == 0.75


def test_the_column_row_order_ends_on_the_rows_by_hand():
    """One iteration of ``column_row``: the column pass above, then rows of 14/15 and 16/15:
    [[5/14, 9/14], [5/8, 3/8]], whose rows sum to 1."""
    got = sinkhorn(LOGITS, 0.0, 1, order="column_row").double()
    assert torch.allclose(got, torch.tensor([[5 / 14, 9 / 14], [5 / 8, 3 / 8]], dtype=torch.float64), rtol=1e-6)


def test_the_shipped_tiny_model_keeps_the_order_it_was_trained_with():
    """The bundled checkpoint names its order; official configs, which have no such key, get DeepInfer's."""
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config

    values = json.loads((Path(__file__).parents[2] / "models" / "tiny" / "config.json").read_text())
    assert DeepseekV41Config.from_dict(values).hc_sinkhorn_order == "column_row"
    del values["text_config"]["hc_sinkhorn_order"]
    assert DeepseekV41Config.from_dict(values).hc_sinkhorn_order == "deepinfer"
    values["text_config"]["hc_sinkhorn_order"] = "rows_first"
    with pytest.raises(ValueError, match=r"hc_sinkhorn_order must be one of \['deepinfer', 'column_row'\]"):
        DeepseekV41Config.from_dict(values)
