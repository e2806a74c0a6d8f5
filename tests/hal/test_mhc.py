import math

import pytest
import torch

from deepinfer.hal.ops.mhc import mhc_mixes, mhc_post, mhc_post_pre, mhc_pre, sinkhorn
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


def _token_mixes(stream_rows, fn, norm_eps):
    """One token's mixes as explicit dot products, scaled by 1 / rms of the flattened streams."""
    flat = torch.cat(list(stream_rows))
    rms = math.sqrt(float((flat * flat).sum()) / flat.numel() + norm_eps)
    return [float(torch.dot(flat, fn_row)) / rms for fn_row in fn]


def _sinkhorn_lists(logits, eps, iters, order="deepinfer"):
    n = len(logits)
    matrix = []
    for row in logits:
        exps = [math.exp(v - max(row)) for v in row]
        matrix.append([e / sum(exps) + eps for e in exps])
    def by_columns(matrix):
        column_sums = [sum(matrix[m][c] for m in range(n)) for c in range(n)]
        return [[matrix[m][c] / (column_sums[c] + eps) for c in range(n)] for m in range(n)]

    def by_rows(matrix):
        return [[v / (sum(row) + eps) for v in row] for row in matrix]

    if order == "column_row":  # iters x (columns, rows)
        for _ in range(iters):
            matrix = by_rows(by_columns(matrix))
        return matrix
    if iters:  # DeepInfer's: the columns first, then (rows, columns) pairs: 2 * iters - 1 passes
        matrix = by_columns(matrix)
    for _ in range(iters - 1):
        matrix = by_columns(by_rows(matrix))
    return matrix


def mhc_mixes_float64(residual, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters, sinkhorn_order="deepinfer"):
    hc = residual.shape[1]
    scale, base = scale.tolist(), base.tolist()
    pre, post, comb = [], [], []
    for streams in residual:
        m = _token_mixes(streams, fn, norm_eps)
        pre.append([_sigmoid(scale[0] * m[i] + base[i]) + hc_eps for i in range(hc)])
        post.append([2 * _sigmoid(scale[1] * m[hc + i] + base[hc + i]) for i in range(hc)])
        flat_logits = [scale[2] * m[2 * hc + j] + base[2 * hc + j] for j in range(hc * hc)]
        logits = [flat_logits[r * hc:(r + 1) * hc] for r in range(hc)]
        comb.append(_sinkhorn_lists(logits, hc_eps, sinkhorn_iters, sinkhorn_order))
    return tuple(torch.tensor(v, dtype=torch.float64) for v in (pre, post, comb))


def mhc_pre_float64(residual, pre):
    out = torch.zeros(residual.shape[0], residual.shape[2], dtype=torch.float64)
    for m in range(residual.shape[1]):
        out += pre[:, m:m + 1] * residual[:, m]
    return out


def mhc_post_float64(y, residual, post, comb):
    tokens, hc, _ = residual.shape
    out = torch.zeros_like(residual)
    for t in range(tokens):
        for n in range(hc):
            out[t, n] = post[t, n] * y[t] + sum(comb[t, m, n] * residual[t, m] for m in range(hc))
    return out


def mhc_head_float64(residual, fn, scale, base, norm_eps, hc_eps):
    weights = []
    for streams in residual:
        m = _token_mixes(streams, fn, norm_eps)
        weights.append([_sigmoid(scale.item() * v + b) + hc_eps for v, b in zip(m, base.tolist())])
    return torch.tensor(weights, dtype=torch.float64)


def mhc_post_pre_float64(y, residual, post, comb, pre, norm_weight=None, norm_eps=1e-6):
    new = mhc_post_float64(y, residual, post, comb)
    x = mhc_pre_float64(new, pre)
    if norm_weight is not None:  # each row over its root mean square, one row at a time
        x = torch.stack([row / math.sqrt(float((row * row).sum()) / row.numel() + norm_eps) for row in x]) * norm_weight
    return new, x


ORACLES = {"mhc_mixes": mhc_mixes_float64, "mhc_pre": mhc_pre_float64, "mhc_post": mhc_post_float64,
           "mhc_post_pre": mhc_post_pre_float64, "mhc_head": mhc_head_float64}


@pytest.mark.parametrize("op, case", [(op, c.name) for op in ORACLES for c in SPECS[op].cases])
def test_mhc_matches_float64(op, case):
    check_against_oracle(op, case, ORACLES[op])


def test_mixes_by_hand():
    # hc=2, H=1, both streams 1: mixes equal fn's row sums; only the first comb logit is ln 3
    fn = torch.zeros(8, 2)
    fn[4, 0] = math.log(3)
    pre, post, comb = mhc_mixes(torch.ones(1, 2, 1), fn, torch.ones(3), torch.zeros(8),
                                norm_eps=0.0, hc_eps=0.0, sinkhorn_iters=1)
    assert torch.allclose(pre, torch.tensor([[0.5, 0.5]]))
    assert torch.allclose(post, torch.tensor([[1.0, 1.0]]))
    # softmax rows [3/4, 1/4], [1/2, 1/2]; one iteration is one column pass: [3/5, 1/3], [2/5, 2/3]
    assert torch.allclose(comb, torch.tensor([[[3 / 5, 1 / 3], [2 / 5, 2 / 3]]]))


def test_post_mixes_from_stream_m_into_stream_n_by_hand():
    out = mhc_post(y=torch.tensor([[1.0]]), residual=torch.tensor([[[2.0], [3.0]]]),
                   post=torch.tensor([[0.5, 1.0]]), comb=torch.tensor([[[0.5, 0.5], [0.25, 0.75]]]))
    assert out.tolist() == [[[2.25], [4.25]]]


def test_post_pre_reads_the_next_input_from_the_stored_trunk():
    # the new streams 2.25 and 4.25 (as in the test above), read with pre [1, 2]: 10.75. In bf16 the
    # input is read from the stored (rounded) trunk: 1/3 is kept as 0.333984375, and 3 x that rounds to 1
    new, x = mhc_post_pre(y=torch.tensor([[1.0]]), residual=torch.tensor([[[2.0], [3.0]]]),
                          post=torch.tensor([[0.5, 1.0]]), comb=torch.tensor([[[0.5, 0.5], [0.25, 0.75]]]),
                          pre=torch.tensor([[1.0, 2.0]]))
    assert new.tolist() == [[[2.25], [4.25]]] and x.tolist() == [[10.75]]
    third = torch.tensor([[[1.0 / 3.0]]], dtype=torch.bfloat16)
    new, x = mhc_post_pre(y=torch.zeros(1, 1, dtype=torch.bfloat16), residual=third, post=torch.zeros(1, 1),
                          comb=torch.ones(1, 1, 1), pre=torch.tensor([[3.0]]))
    assert new.item() == 0.333984375 and x.item() == 1.0


def test_post_pre_normalises_the_next_input_by_hand():
    # the next input [3, 4] (streams 1 and 2, read with pre [1, 1]) has root mean square sqrt(12.5);
    # the norm weight [1, 2] doubles its second column
    new, x = mhc_post_pre(y=torch.zeros(1, 2), residual=torch.tensor([[[1.0, 2.0], [2.0, 2.0]]]),
                          post=torch.zeros(1, 2), comb=torch.eye(2).unsqueeze(0), pre=torch.ones(1, 2),
                          norm_weight=torch.tensor([1.0, 2.0]), norm_eps=0.0)
    rms = math.sqrt(12.5)
    assert new.tolist() == [[[1.0, 2.0], [2.0, 2.0]]]
    assert torch.allclose(x, torch.tensor([[3 / rms, 8 / rms]]))


def test_pre_by_hand():
    out = mhc_pre(torch.tensor([[[1.0, 2.0], [10.0, 20.0]]]), torch.tensor([[0.5, 0.25]]))
    assert out.tolist() == [[3.0, 6.0]]


def test_many_sinkhorn_iterations_give_a_doubly_stochastic_matrix():
    comb = sinkhorn(torch.randn(16, 4, 4, generator=torch.Generator().manual_seed(3)), 1e-6, 50)
    assert torch.allclose(comb.sum(dim=-1), torch.ones(16, 4), atol=1e-4)
    assert torch.allclose(comb.sum(dim=-2), torch.ones(16, 4), atol=1e-4)
    assert (comb > 0).all()


def test_few_sinkhorn_iterations_are_not_yet_doubly_stochastic():
    comb = sinkhorn(torch.randn(16, 4, 4, generator=torch.Generator().manual_seed(3)), 1e-6, 0)
    assert not torch.allclose(comb.sum(dim=-2), torch.ones(16, 4), atol=1e-2)


def test_bf16_residual_keeps_its_dtype():
    residual = torch.randn(2, 4, 8).bfloat16()
    assert mhc_pre(residual, torch.rand(2, 4)).dtype == torch.bfloat16
    out = mhc_post(torch.randn(2, 8).bfloat16(), residual, torch.rand(2, 4), torch.rand(2, 4, 4))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, match", [
    ({"residual": torch.zeros(2, 8)}, "residual must be \\[T, hc, H\\], got shape \\(2, 8\\)"),
    ({"fn": torch.zeros(24, 16)}, "fn must have shape \\[24, 32\\], got \\[24, 16\\]"),
    ({"scale": torch.zeros(2)}, "scale must have shape \\[3\\]"),
    ({"base": torch.zeros(20)}, "base must have shape \\[24\\]"),
    ({"sinkhorn_iters": -1}, "sinkhorn_iters must be >= 0, got -1"),
])
def test_bad_mixes_arguments_are_rejected(kwargs, match):
    args = {"residual": torch.zeros(2, 4, 8), "fn": torch.zeros(24, 32), "scale": torch.zeros(3),
            "base": torch.zeros(24), "norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        mhc_mixes(**args)


def test_bad_post_arguments_are_rejected():
    with pytest.raises(ValueError, match="comb must have shape \\[2, 4, 4\\], got \\[2, 4\\]"):
        mhc_post(torch.zeros(2, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 4))
