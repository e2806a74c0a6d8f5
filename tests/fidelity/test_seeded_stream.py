"""Seeded draws against DeepInfer 0.1.0's PyTorch reference stream (issue 29), worked out by hand
from the rule in plain Python integers.

A draw at ``(seed, position, case)``: ``m = (3 * position + case) * GAMMA`` mod 2**64; the
SplitMix64 state is ``seed + (m ^ (m << 13))`` for a token draw (case 0, case 1) and
``seed ^ m`` for the acceptance uniform (case 2); SplitMix64 adds ``GAMMA`` and mixes, and the
uniform is its top 53 bits over 2**53. The token is the first whose float64 prefix sum of the
row's probabilities, summed left to right, exceeds ``u * total``. Verification row ``j`` draws at
``base + j * 10000019``; draft draws use the seed ``seed + 1000000007``."""
import numpy as np
import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.decoding.sampler import SlotTokens, emit
from deepinfer.engine.device import Runtime
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Chunk
from deepinfer.hal import OpTable
from deepinfer.hal.ops.sampling import (
    CASE_ACCEPT, CASE_RESAMPLE, CASE_SAMPLE, SEED_NAMESPACE_DRAFT, VERIFY_ROW_STRIDE, cdf_draw, draw_uniform, sample,
    verify_row_positions,
)
from deepinfer.hal.ops.speculative import speculative_accept

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _int64(value: int) -> torch.Tensor:
    return torch.tensor([value - (1 << 64) if value >= 1 << 63 else value])


def _uniform(seed: int, position: int, case: int) -> float:
    return draw_uniform(_int64(seed), torch.tensor([position]), case).item()


def test_seed_42_position_7_case_0_step_by_step():
    m = (3 * 7 + 0) * GAMMA & MASK
    assert m == 0xFA8CFC37711C2DB9
    state = (42 + (m ^ (m << 13 & MASK))) & MASK
    assert state == 0x650A1214F4AB0DE3
    z = (state + GAMMA) & MASK
    assert z == 0x03418BCE73F589F8
    z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9 & MASK
    assert z == 0x088EFE3452222679
    z = (z ^ z >> 27) * 0x94D049BB133111EB & MASK
    assert z == 0x476B5C345D80A211
    z ^= z >> 31
    assert z == 0x476B5C34D3561A79
    assert z >> 11 == 2512845889235651
    assert _uniform(42, 7, CASE_SAMPLE) == 2512845889235651 / 2 ** 53 == 0.27898193635640955


def test_the_other_cases_at_the_same_seed_and_position():
    # case 1: m = 22 * GAMMA, the same additive mix
    m = 22 * GAMMA & MASK
    assert (42 + (m ^ (m << 13 & MASK))) & MASK == 0x167A6BFC255F69F8
    assert _uniform(42, 7, CASE_RESAMPLE) == 0.2983058933830096
    # case 2, the acceptance uniform: the state is seed ^ m with m = 23 * GAMMA
    m = 23 * GAMMA & MASK
    assert 42 ^ m == 0x36FBEFAA6FB125C9
    assert _uniform(42, 7, CASE_ACCEPT) == 0.6836669590414755


def test_seeds_wrap_mod_2_64():
    # seed 2**64 - 1: the state is 0x650a1214f4ab0de3 - 43 mod 2**64
    assert _uniform(MASK, 7, CASE_SAMPLE) == 0.17229140271257626


def test_the_token_a_uniform_selects_from_a_small_distribution():
    # float32 [.1, .2, .3, .4] summed left to right in float64: .1000000015, .3000000045,
    # .6000000164, 1.0000000224; u = .27898 (seed 42, position 7) lands in token 1's interval,
    # u = .79144 (position 100) in token 3's, u = .09686 (position 20000138) in token 0's
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    cumulative = np.cumsum(probs[0].double().numpy())
    for position, token in ((7, 1), (100, 3), (20000138, 0)):
        target = _uniform(42, position, CASE_SAMPLE) * cumulative[-1]
        assert int(np.argmax(cumulative > target)) == token
        assert cdf_draw(probs, _int64(42), torch.tensor([position]), CASE_SAMPLE).tolist() == [token]


def test_zero_probability_tokens_are_never_drawn():
    # [0, .5, 0, .5]: u < .5 gives token 1, u >= .5 token 3; tokens 0 and 2 add nothing to the CDF
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(64, 4)
    positions = torch.arange(64) * 31
    tokens = cdf_draw(probs, torch.full((64,), 42), positions, CASE_SAMPLE)
    uniforms = draw_uniform(torch.full((64,), 42), positions, CASE_SAMPLE)
    assert tokens.tolist() == [1 if u < 0.5 else 3 for u in uniforms.tolist()]
    assert {1, 3} == set(tokens.tolist())


def test_verify_rows_draw_at_base_plus_j_times_10000019():
    assert VERIFY_ROW_STRIDE == 10000019
    rows = verify_row_positions(torch.full((3,), 100), torch.arange(3))
    assert rows.tolist() == [100, 10000119, 20000138]
    assert [_uniform(42, p, CASE_SAMPLE) for p in rows.tolist()] == [0.7914407920527083, 0.7611585666564306,
                                                                     0.09686006238773504]


def test_draft_draws_use_the_seed_plus_1000000007():
    # draft step i of a request whose step emitted the token at position 6 draws at 6 + 1 + i
    assert SEED_NAMESPACE_DRAFT == 1000000007
    assert _uniform(42 + 1000000007, 7, CASE_SAMPLE) == 0.028999530032866927
    two = torch.zeros(1, 2)  # two equal tokens: token 1 exactly when u >= 1/2
    args = (two, torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.int64), _int64(MASK - 5), torch.tensor([7]))
    for seed_used, namespace in ((MASK - 5, 0), ((MASK - 5 + 1000000007) & MASK, SEED_NAMESPACE_DRAFT)):
        token, _ = sample(*args, namespace=namespace)
        assert token.item() == int(_uniform(seed_used, 7, CASE_SAMPLE) >= 0.5)


class _Recording:
    """An op table that records the positions each sampling op is called with."""

    def __init__(self):
        self.ops, self.positions = OpTable("reference"), {}

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def call(*args, **kwargs):
            self.positions.setdefault(name, []).append(args[5] if name == "sample" else args[4])
            return op(*args, **kwargs)
        return call


def _step(slots=None, chained=False):
    """One step: request 0 verifies drafts [1, 2] after its token at position 40 (rows j = 0, 1,
    2), request 1 is a 4-token prompt (base 4, DeepInfer's seqlen_k)."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    decoding = Request(0, None, [5] * 40, params, 11)
    decoding.draft_logprobs = torch.log_softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(0)), -1)
    chunks = [Chunk(decoding, [3, 1, 2], start=0 if chained else 40, samples=True, drafts=[1, 2], slot=0,
                    chained=chained),
              Chunk(Request(1, None, [5, 6, 7, 8], params, 12), [5, 6, 7, 8], start=0, samples=True, slot=1)]
    ops = _Recording()
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    emission = emit(ops, Runtime(torch.device("cpu")), chunks, logits, slots=slots).collect()
    return ops.positions, emission


@pytest.mark.parametrize("chained", [False, True], ids=["start_on_the_host", "start_on_the_device"])
def test_emit_keys_verify_rows_by_base_plus_j_and_keeps_token_positions_apart(chained):
    slots = SlotTokens.zeros(2, 2, torch.device("cpu"))
    slots.length[0] = 40
    positions, emission = _step(slots, chained)
    assert positions["sample"][0].tolist() == [41, 41 + 10000019, 41 + 2 * 10000019, 4]
    assert positions["speculative_accept"][0].tolist() == [41, 41 + 10000019]
    accepted = emission[0].accepted
    assert slots.length.tolist() == [41 + accepted, 4], "a slot keeps its last token's position, not its draw's"


def test_a_row_draws_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 12, 300
    args = {"logits": 2 * torch.randn(rows, vocab, generator=gen), "temperature": 0.5 + torch.rand(rows, generator=gen),
            "top_p": torch.full((rows,), 0.95), "top_k": torch.full((rows,), 40),
            "seeds": torch.randint(-(1 << 63), (1 << 63) - 1, (rows,), generator=gen),
            "positions": verify_row_positions(torch.randint(0, 1 << 20, (rows,), generator=gen),
                                              torch.arange(rows) % 3)}
    tokens, logprobs = sample(**args)
    for batch in (torch.arange(rows).flip(0), torch.tensor([5]), torch.tensor([5, 0, 5, 11, 3])):
        again, _ = sample(**{k: v[batch] for k, v in args.items()})
        assert torch.equal(again, tokens[batch])
    draft = torch.log_softmax(2 * torch.randn(rows, vocab, generator=gen), dim=-1)
    ids = torch.multinomial(draft.exp(), 1, generator=gen)[:, 0]
    verify = (logprobs, draft, ids, args["seeds"], args["positions"])
    accepted, resampled = speculative_accept(*verify)
    for batch in (torch.arange(rows).flip(0), torch.tensor([7]), torch.tensor([7, 7, 2])):
        again = speculative_accept(*(t[batch] for t in verify))
        assert torch.equal(again[0], accepted[batch]) and torch.equal(again[1], resampled[batch])
