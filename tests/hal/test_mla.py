"""Sparse MLA against a float64 per-row, per-head oracle (the sink as a virtual zero-value key)."""
import math

import numpy as np
import pytest
import torch

from deepinfer.hal import formats
from deepinfer.hal.ops.mla import mla_sparse_decode, mla_sparse_prefill
from deepinfer.hal.spec import SPECS, compare
from tests.hal.oracle import check_against_oracle


def attend_one_query(q_heads, keys, sink, scale):
    """numpy float64, q_heads [h, D], keys [n, D] (n may be 0): out [h, D], lse [h] from explicit sums."""
    heads, dim = q_heads.shape
    out, lse = np.zeros((heads, dim)), np.full(heads, -math.inf)
    if keys.shape[0] == 0:
        return out, lse
    for h in range(heads):
        logits = scale * (keys @ q_heads[h])
        top = logits.max()
        weights = np.exp(logits - top)
        total = weights.sum()
        lse[h] = top + math.log(total)
        out[h] = (weights @ keys) / (total + math.exp(sink[h] - top))
    return out, lse


def stacked(results, out_shape, lse_shape):
    out = np.stack([r[0] for r in results]).reshape(out_shape)
    return torch.from_numpy(out), torch.from_numpy(np.stack([r[1] for r in results]).reshape(lse_shape))


def mla_sparse_prefill_float64(q, kv, indices, sink, scale):
    q, kv, sink = q.numpy(), kv.numpy(), sink.numpy()
    results = [attend_one_query(q[t], kv[[i for i in row if i >= 0]], sink, scale)
               for t, row in enumerate(indices.tolist())]
    return stacked(results, q.shape, q.shape[:2])


def decoded_rows(cache, indices, fmt):
    flat = cache.view(-1, cache.shape[-1])
    return [formats.decode_tokens(flat[[i for i in row if i >= 0]], fmt).double().numpy()
            for row in indices.tolist()]


def mla_sparse_decode_float64(q, cache, indices, sink, scale, cache_format="fp8", extra_cache=None,
                              extra_indices=None, extra_format="fp4"):
    batch, s_q, heads, dim = q.shape
    queries = q.reshape(batch * s_q, heads, dim).numpy()
    main = decoded_rows(cache, indices.reshape(batch * s_q, -1), cache_format)
    extra = decoded_rows(extra_cache, extra_indices.reshape(batch * s_q, -1), extra_format) \
        if extra_cache is not None else [np.zeros((0, dim))] * len(main)
    results = [attend_one_query(queries[n], np.concatenate((main[n], extra[n])), sink.numpy(), scale)
               for n in range(len(main))]
    return stacked(results, q.shape, (batch, s_q, heads))


def assert_close(got, want, op="mla_sparse_prefill"):
    failures = compare(got, want, SPECS[op].tolerance(torch.float32))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", [c.name for c in SPECS["mla_sparse_prefill"].cases])
def test_prefill_matches_float64(case):
    check_against_oracle("mla_sparse_prefill", case, mla_sparse_prefill_float64)


@pytest.mark.parametrize("case", [c.name for c in SPECS["mla_sparse_decode"].cases])
def test_decode_matches_float64(case):
    check_against_oracle("mla_sparse_decode", case, mla_sparse_decode_float64)


def test_hand_worked_sink():
    # one key, q . k = 0: lse = 0 and out = k * sigmoid(0 - sink); sink ln 3 gives 1 / (1 + 3)
    key = torch.tensor([[2.0, -4.0, 8.0, 1.0]])
    out, lse = mla_sparse_prefill(torch.zeros(1, 2, 4), key, torch.tensor([[0]], dtype=torch.int32),
                                  torch.tensor([0.0, math.log(3.0)]), 1.0)
    assert lse.tolist() == [[0.0, 0.0]]
    assert_close(out[0], torch.stack((key[0] * 0.5, key[0] * 0.25)))


def test_hand_worked_softmax_over_two_keys_and_duplicates():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    q = torch.tensor([[[0.0, math.log(3.0)]]])  # logits 0 and ln 3: weights 1/4 and 3/4, lse ln 4
    out, lse = mla_sparse_prefill(q, keys, torch.tensor([[0, -1, 1]], dtype=torch.int32),
                                  torch.tensor([math.log(4.0)]), 1.0)  # sink ln 4 halves the output
    assert_close(lse, torch.tensor([[math.log(4.0)]]))
    assert_close(out, torch.tensor([[[0.125, 0.375]]]))
    # a key listed twice counts twice: lse ln 2, out = k * sigmoid(ln 2 - 0) = k * 2 / 3
    out, lse = mla_sparse_prefill(torch.zeros(1, 1, 2), keys, torch.tensor([[1, 1]], dtype=torch.int32),
                                  torch.zeros(1), 1.0)
    assert_close(lse, torch.tensor([[math.log(2.0)]]))
    assert_close(out, torch.tensor([[[0.0, 2 / 3]]]))


def test_row_without_valid_key_gives_zero_and_minus_inf():
    out, lse = mla_sparse_prefill(torch.randn(2, 3, 8), torch.randn(4, 8),
                                  torch.tensor([[-1, -1], [2, -1]], dtype=torch.int32), torch.zeros(3), 0.5)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all() and not torch.isnan(out).any()


def case_inputs(op, case, seed=0):
    return SPECS[op].case(case).make_inputs(torch.Generator().manual_seed(seed), torch.device("cpu"))


def all_rows_decoded(cache, fmt):
    return formats.decode_tokens(cache.view(-1, cache.shape[-1]), fmt)


@pytest.mark.parametrize("case", ["tiny_fp8_fp4", "tiny_empty_rows", "v41"])
def test_decode_equals_prefill_on_decoded_rows(case):
    args = case_inputs("mla_sparse_decode", case, seed=3)
    main = all_rows_decoded(args["cache"], args["cache_format"])
    extra = all_rows_decoded(args["extra_cache"], args["extra_format"])
    shifted = torch.where(args["extra_indices"] >= 0, args["extra_indices"] + main.shape[0], -1)
    batch, s_q, heads, dim = args["q"].shape
    indices = torch.cat((args["indices"], shifted), dim=-1).reshape(batch * s_q, -1)
    want_out, want_lse = mla_sparse_prefill(args["q"].reshape(-1, heads, dim), torch.cat((main, extra)),
                                            indices, args["sink"], args["scale"])
    out, lse = mla_sparse_decode(**args)
    assert_close(out.reshape(-1, heads, dim), want_out, "mla_sparse_decode")
    assert_close(lse.reshape(-1, heads), want_lse, "mla_sparse_decode")


def test_prefill_in_query_chunks_equals_one_pass(monkeypatch):
    args = case_inputs("mla_sparse_prefill", "tiny")
    whole = mla_sparse_prefill(**args)
    monkeypatch.setattr("deepinfer.hal.ops.mla.GATHER_BUDGET", 1)
    chunked = mla_sparse_prefill(**args)
    assert_close(chunked, whole)


def fp8_cache(rows):
    return formats.encode_tokens(torch.randn(rows, 512), "fp8")


@pytest.mark.parametrize("call,match", [
    (lambda: mla_sparse_prefill(torch.randn(2, 1, 4), torch.randn(3, 4), torch.tensor([[0], [3]]).int(),
                                torch.zeros(1), 1.0), r"indices must lie in \[0, 3\).*\[0, 3\]"),
    (lambda: mla_sparse_prefill(torch.randn(2, 1, 4), torch.randn(3, 8), torch.zeros(2, 1).int(),
                                torch.zeros(1), 1.0), r"kv must be \[S, D=4\], got \(3, 8\)"),
    (lambda: mla_sparse_prefill(torch.randn(2, 1, 4), torch.randn(3, 4), torch.zeros(3, 1).int(),
                                torch.zeros(1), 1.0), r"indices must be int32 \[2, K\]"),
    (lambda: mla_sparse_prefill(torch.randn(2, 2, 4), torch.randn(3, 4), torch.zeros(2, 1).int(),
                                torch.zeros(3), 1.0), r"sink must be float32 \[h=2\], got \(3,\)"),
    (lambda: mla_sparse_decode(torch.randn(1, 1, 2, 512), fp8_cache(4), torch.zeros(1, 1, 2).int(),
                               torch.zeros(2), 1.0, extra_cache=fp8_cache(4)),
     "extra_cache and extra_indices go together; got only extra_cache"),
    (lambda: mla_sparse_decode(torch.randn(1, 1, 2, 64), fp8_cache(4), torch.zeros(1, 1, 2).int(),
                               torch.zeros(2), 1.0), "holds 512-dim tokens but q has D=64"),
    (lambda: mla_sparse_decode(torch.randn(1, 1, 2, 512), fp8_cache(4), torch.zeros(1, 1, 2).int(),
                               torch.zeros(2), 1.0, cache_format="fp4"), r"uint8 \[..., 288\]"),
    (lambda: mla_sparse_decode(torch.randn(1, 1, 2, 512), fp8_cache(4), torch.tensor([[[4, 0]]]).int(),
                               torch.zeros(2), 1.0), r"indices must lie in \[0, 4\)"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()
