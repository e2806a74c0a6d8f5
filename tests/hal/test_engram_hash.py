import pytest
import torch

from deepinfer.hal.ops.engram_hash import engram_hash
from deepinfer.hal.spec import SPECS


def test_a_hand_worked_example():
    """One layer, orders 2 and 3, two heads: multipliers 3, 5, 7; tables 5, 7 (order 2), 11, 13 (order 3).

    Row [4, 2, 9]: products 12, 10, 63; order 2 hashes 12 ^ 10 = 6, rows 6 % 5 = 1 and 6 % 7 = 6 + 5;
    order 3 hashes 6 ^ 63 = 57, rows 57 % 11 = 2 + 12 and 57 % 13 = 5 + 23.
    Row [2, 2, 2]: products 6, 10, 14; 6 ^ 10 = 12: 2 and 5 + 5; 12 ^ 14 = 2: 2 + 12 and 2 + 23."""
    got = engram_hash(torch.tensor([[4, 2, 9], [2, 2, 2]]), torch.tensor([[3, 5, 7]]),
                      torch.tensor([[[5, 7], [11, 13]]]))
    assert got.tolist() == [[[1, 11, 14, 28]], [[2, 10, 14, 25]]]


@pytest.mark.parametrize("case", [c.name for c in SPECS["engram_hash"].cases if c.size == "tiny"])
def test_every_row_matches_python_ints(case):
    """Large multipliers too: the products stay exact in int64 (multipliers below int64 max / vocab)."""
    inputs = SPECS["engram_hash"].case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    got = engram_hash(**inputs)
    ids, multipliers, sizes = (inputs[k].tolist() for k in ("ngram_ids", "multipliers", "table_sizes"))
    for t, row in enumerate(ids):
        for layer, (mults, layer_sizes) in enumerate(zip(multipliers, sizes)):
            want, offset, hashed = [], 0, row[0] * mults[0]
            for order, heads in enumerate(layer_sizes, start=1):
                hashed ^= row[order] * mults[order]
                for size in heads:
                    want.append(hashed % size + offset)
                    offset += size
            assert got[t, layer].tolist() == want, (case, t, layer)


def test_inconsistent_shapes_are_refused():
    with pytest.raises(ValueError, match=r"table_sizes \(1, 2, 2\) \(\[L, N - 1, H\]\)"):
        engram_hash(torch.zeros(3, 4, dtype=torch.int64), torch.ones(1, 4, dtype=torch.int64),
                    torch.ones(1, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="ngram_ids must be int64"):
        engram_hash(torch.zeros(3, 3, dtype=torch.int32), torch.ones(1, 3, dtype=torch.int64),
                    torch.ones(1, 2, 2, dtype=torch.int64))
