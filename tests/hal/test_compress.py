import math

import pytest
import torch

from deepinfer.hal.ops.compress import compress_tokens
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def member_pair(t, q, latent, score, positions, state_slots, chunk_start, state):
    """(score, latent) of position q in token t's sequence: a row of this call or a ring entry."""
    if q >= chunk_start[t]:
        row = t - (int(positions[t]) - q)
        return score[row], latent[row]
    entry = state[int(state_slots[t]), q % state.shape[1]]
    return entry[0], entry[1]


def compress_float64(latent, score, positions, state_slots, chunk_start, state, ratio):
    """Token by token; the softmax written out as exp(s_i) / sum_j exp(s_j) per channel."""
    out = torch.zeros_like(latent)
    emit = torch.zeros(latent.shape[0], dtype=torch.bool)
    for t in range(latent.shape[0]):
        p = int(positions[t])
        if ratio == 1:
            out[t], emit[t] = latent[t], True
            continue
        if (p + 1) % ratio:
            continue
        pairs = [member_pair(t, q, latent, score, positions, state_slots, chunk_start, state)
                 for q in range(p - ratio + 1, p + 1)]
        numerator = sum(torch.exp(s) * value for s, value in pairs)
        out[t], emit[t] = numerator / sum(torch.exp(s) for s, _ in pairs), True
    return out, emit


@pytest.mark.parametrize("case", [c.name for c in SPECS["compress_tokens"].cases])
def test_compress_matches_float64(case):
    check_against_oracle("compress_tokens", case, compress_float64)


@pytest.mark.parametrize("case", [c.name for c in SPECS["compress_tokens"].cases if "c1" not in c.name])
def test_state_holds_every_tokens_pair_latest_wins(case):
    inputs = SPECS["compress_tokens"].case(case).make_inputs(torch.Generator().manual_seed(1), torch.device("cpu"))
    want = inputs["state"].clone()
    for t, (p, slot) in enumerate(zip(inputs["positions"].tolist(), inputs["state_slots"].tolist())):
        want[slot, p % want.shape[1], 0] = inputs["score"][t]
        want[slot, p % want.shape[1], 1] = inputs["latent"][t]
    compress_tokens(**inputs)
    assert torch.equal(inputs["state"], want)


def test_c2_by_hand():
    latent = torch.tensor([[4.0, 2.0], [8.0, -2.0], [1.0, 1.0]])
    score = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]])
    out, emit = compress_tokens(latent, score, torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.int64),
                                torch.zeros(3, dtype=torch.int64), torch.zeros(1, 2, 2, 2), ratio=2)
    assert emit.tolist() == [False, True, False]
    assert out.dtype == torch.bfloat16  # 7 and 0 are bf16 values: the rounding keeps them exactly
    assert torch.equal(out.float(), torch.tensor([[0.0, 0.0], [7.0, 0.0], [0.0, 0.0]]))


def run_in_chunks(latent, score, chunk, ratio, ring_length=7):
    """One sequence (slot 1 of 2), fed ``chunk`` tokens per call; returns the concatenated outputs."""
    state = torch.zeros(2, ring_length, 2, latent.shape[1])
    outs, emits = [], []
    for first in range(0, latent.shape[0], chunk):
        rows = slice(first, min(first + chunk, latent.shape[0]))
        count = rows.stop - first
        out, emit = compress_tokens(latent[rows], score[rows], torch.arange(first, rows.stop),
                                    torch.ones(count, dtype=torch.int64), torch.full((count,), first),
                                    state, ratio)
        outs.append(out)
        emits.append(emit)
    return torch.cat(outs), torch.cat(emits)


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_prefill_equals_one_call_exactly(gen, ratio, chunk):
    latent, score = torch.randn(17, 64, generator=gen), 3 * torch.randn(17, 64, generator=gen)
    whole_out, whole_emit = run_in_chunks(latent, score, chunk=17, ratio=ratio)
    out, emit = run_in_chunks(latent, score, chunk=chunk, ratio=ratio)
    assert emit.tolist() == whole_emit.tolist() == [(p + 1) % ratio == 0 for p in range(17)]
    assert torch.equal(out, whole_out)


def test_rollback_recomputes_group_from_ring_and_new_token(gen):
    latent, score = torch.randn(7, 64, generator=gen), torch.randn(7, 64, generator=gen)
    new_latent, new_score = torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen)
    slot = torch.zeros(7, dtype=torch.int64)
    state = torch.zeros(1, 7, 2, 64)
    compress_tokens(latent, score, torch.arange(7), slot, slot, state, ratio=2)
    out, emit = compress_tokens(new_latent, new_score, torch.tensor([5, 6]), slot[:2], torch.tensor([5, 5]),
                                state, ratio=2)
    assert emit.tolist() == [True, False]
    replayed_latent = torch.cat((latent[:5], new_latent[:1]))
    replayed_score = torch.cat((score[:5], new_score[:1]))
    replayed, _ = run_in_chunks(replayed_latent, replayed_score, chunk=6, ratio=2)
    assert torch.equal(out[0], replayed[5])
    weights = torch.softmax(torch.stack((score[4], new_score[0])).double(), dim=0)
    want = weights[0] * latent[4].double() + weights[1] * new_latent[0].double()
    assert torch.allclose(out[0].double(), want, rtol=2**-8, atol=1e-6)  # one bf16 rounding of the output
    assert torch.equal(state[0, 5, 1], new_latent[0]) and torch.equal(state[0, 4, 1], latent[4])


def test_c1_returns_latent_without_state(gen):
    latent = torch.randn(3, 8, generator=gen)
    positions = torch.tensor([4, 5, 6])
    out, emit = compress_tokens(latent, None, positions, torch.zeros(3, dtype=torch.int64), positions, None, 1)
    assert torch.equal(out, latent.to(torch.bfloat16)) and emit.all()


def test_bad_inputs_are_rejected():
    latent, zeros = torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64)
    positions = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="needs state float32 \\[num_slots, L >= 2, 2, 8\\], got torch.float32"):
        compress_tokens(latent, latent, positions, zeros, zeros, torch.zeros(1, 1, 2, 8), 2)
    with pytest.raises(ValueError, match="needs score"):
        compress_tokens(latent, None, positions, zeros, zeros, torch.zeros(1, 4, 2, 8), 2)
    with pytest.raises(ValueError, match=r"state_slots must lie in \[0, 1\)"):
        compress_tokens(latent, latent, positions, zeros + 1, zeros, torch.zeros(1, 4, 2, 8), 2)
    with pytest.raises(ValueError, match="positions must be int64"):
        compress_tokens(latent, latent, positions.int(), zeros, zeros, torch.zeros(1, 4, 2, 8), 2)
    with pytest.raises(ValueError, match="contiguous rows"):
        compress_tokens(latent, latent, torch.tensor([1, 0]), zeros, zeros, torch.zeros(1, 4, 2, 8), 2)
    with pytest.raises(ValueError, match="ratio must be an int >= 1"):
        compress_tokens(latent, latent, positions, zeros, zeros, None, 0)
