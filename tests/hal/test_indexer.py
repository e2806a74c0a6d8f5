import pytest
import torch

from deepinfer.hal.formats import cast_back
from deepinfer.hal.ops.indexer import indexer_logits, indexer_topk
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def logits_float64(q, k, weights, q_format="mxfp4", weight_scale=1.0):
    """Query by query and head by head: the dot with every key of its list (the shared one, or its
    sequence's: T / B consecutive queries per sequence), clipped at zero, weighted by the weight
    times ``weight_scale``."""
    weights = weights * weight_scale
    queries = cast_back(q, "mxfp4", 32).double() if q_format == "mxfp4" else q
    per_seq = q.shape[0] // k.shape[0] if k.dim() == 3 else None
    out = torch.zeros(q.shape[0], k.shape[-2], dtype=torch.float64)
    for t in range(q.shape[0]):
        keys = k[t // per_seq] if per_seq else k
        for h in range(q.shape[1]):
            out[t] += weights[t, h] * torch.clamp(torch.mv(keys, queries[t, h]), min=0)
    return out


def topk_float64(logits, starts, lengths, k, row_table=None):
    """Per row in Python: sort the window's offsets by (-logit, offset), keep k, sort, pad; then
    look each offset up in ``row_table``'s row when given."""
    rows = []
    tables = row_table.tolist() if row_table is not None else [None] * len(starts)
    for row, start, length, table in zip(logits.tolist(), starts.tolist(), lengths.tolist(), tables):
        best = sorted(sorted(range(length), key=lambda offset: (-row[start + offset], offset))[:k])
        rows.append([table[o] if table else o for o in best] + [-1] * (k - len(best)))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), k)


@pytest.mark.parametrize("case", [c.name for c in SPECS["indexer_logits"].cases])
def test_indexer_logits_matches_float64(case):
    check_against_oracle("indexer_logits", case, logits_float64)


@pytest.mark.parametrize("case", [c.name for c in SPECS["indexer_topk"].cases])
def test_indexer_topk_matches_oracle(case):
    check_against_oracle("indexer_topk", case, topk_float64)


def test_logits_by_hand():
    q = torch.tensor([[[1.0, 2.0], [-1.0, 1.0]]])
    k = torch.tensor([[1.0, 1.0], [2.0, -1.0], [0.0, 3.0]])
    logits = indexer_logits(q, k, torch.tensor([[0.5, 4.0]]), q_format=None)
    assert torch.equal(logits, torch.tensor([[1.5, 0.0, 15.0]]))


def test_weight_scale_multiplies_bf16_weights_in_float32_by_hand():
    """bf16 weight 3 times weight_scale 1/3 (float32: 0.3333333432674408) is 1.0000000298 in
    float64 and rounds to 1.0 in float32; the logit is that times relu(q . k) = 2."""
    q, k = torch.tensor([[[1.0, 1.0]]]), torch.tensor([[1.0, 1.0]])
    logits = indexer_logits(q, k, torch.tensor([[3.0]], dtype=torch.bfloat16), q_format=None, weight_scale=1 / 3)
    assert logits.dtype == torch.float32 and logits.item() == 2.0
    halved = indexer_logits(q, k, torch.tensor([[3.0]], dtype=torch.bfloat16), q_format=None, weight_scale=0.5)
    assert halved.item() == 3.0


def test_queries_are_cast_through_mxfp4():
    """1.1 in a block whose scale is 2^-2 is 4.4 units, which rounds to the e2m1 value 4: q = 1.0."""
    q, k, weights = torch.full((1, 1, 32), 1.1), torch.ones(1, 32), torch.ones(1, 1)
    assert torch.equal(indexer_logits(q, k, weights), torch.tensor([[32.0]]))
    assert torch.allclose(indexer_logits(q, k, weights, q_format=None), torch.tensor([[35.2]]), rtol=1e-6, atol=0)


def test_topk_by_hand():
    logits = torch.tensor([[5.0, 1.0, 5.0, 3.0, 7.0, 5.0]] * 3)
    chosen = indexer_topk(logits, torch.tensor([1, 0, 2]), torch.tensor([5, 2, 0]), k=2)
    assert chosen.dtype == torch.int32
    assert chosen.tolist() == [[1, 3], [0, 1], [-1, -1]]
    assert indexer_topk(logits[:1], torch.tensor([0]), torch.tensor([6]), k=3).tolist() == [[0, 2, 4]]


def test_topk_window_longer_than_k_never_returns_padding(gen):
    logits = torch.randn(5, 300, generator=gen)
    chosen = indexer_topk(logits, torch.zeros(5, dtype=torch.int64), torch.full((5,), 300), k=64)
    assert (chosen >= 0).all() and (chosen.diff(dim=1) > 0).all()


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="d=48 is not a multiple"):
        indexer_logits(torch.zeros(1, 2, 48), torch.zeros(3, 48), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"weights must be float32 or bf16 \[T, nh\] = \(1, 2\), got torch.float32 "
                                         r"\(2, 1\)"):
        indexer_logits(torch.zeros(1, 2, 32), torch.zeros(3, 32), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="got torch.float16"):
        indexer_logits(torch.zeros(1, 2, 32), torch.zeros(3, 32), torch.zeros(1, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="q_format must be one of"):
        indexer_logits(torch.zeros(1, 2, 32), torch.zeros(3, 32), torch.zeros(1, 2), q_format="fp8")
    with pytest.raises(ValueError, match="must lie in the 4 columns"):
        indexer_topk(torch.zeros(1, 4), torch.tensor([2]), torch.tensor([3]), k=2)
    with pytest.raises(ValueError, match="lengths must be int64"):
        indexer_topk(torch.zeros(1, 4), torch.tensor([0]), torch.tensor([3], dtype=torch.int32), k=2)
