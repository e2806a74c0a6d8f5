"""Top-p and top-k against DeepInfer 0.1.0's order (issue 29), worked out by hand from the rule.

DeepInfer ranks the tokens by logit, ties to the lower token id, and keeps the first
``min(n_p, k)``: ``n_p`` counts the tokens whose preceding mass on the *full* softmax is at most
``top_p`` (the token that crosses ``top_p`` stays). That is our default, ``filter_order="deepinfer"``.
``filter_order="vllm"`` applies top-k first (every tie at the k-th value kept), renormalises, and
keeps the shortest prefix reaching ``top_p`` plus every tie with its last token."""
import math

import pytest
import torch

from deepinfer.hal.ops.sampling import sample


def _kept(logits: list[float], top_p: float = 1.0, top_k: int = -1, filter_order: str = "deepinfer",
          temperature: float = 1.0) -> tuple[list[int], torch.Tensor]:
    """The token ids one row keeps, and its processed log-probabilities."""
    _, logprobs = sample(torch.tensor([logits]), torch.tensor([temperature]), torch.tensor([top_p]),
                         torch.tensor([top_k]), torch.tensor([7]), torch.tensor([0]), filter_order=filter_order)
    return torch.isfinite(logprobs[0]).nonzero()[:, 0].tolist(), logprobs[0]


P_532 = [math.log(0.5), math.log(0.3), math.log(0.2)]


def test_top_p_on_the_full_softmax_then_top_k():
    # p = [.5, .3, .2], top_p .6, k 2. DeepInfer: token 1 has .5 before it (<= .6), token 2 has .8:
    # top-p keeps {0, 1}; top-k keeps the first two of those: {0, 1}, renormalised to [5/8, 3/8]
    kept, logprobs = _kept(P_532, top_p=0.6, top_k=2)
    assert kept == [0, 1]
    torch.testing.assert_close(logprobs[:2], torch.tensor([math.log(5 / 8), math.log(3 / 8)]))


def test_the_vllm_order_keeps_a_different_set_on_the_same_row():
    # vLLM order: top-k {0, 1}, renormalised [5/8, 3/8]; 5/8 already reaches .6, so top-p keeps {0}
    kept, logprobs = _kept(P_532, top_p=0.6, top_k=2, filter_order="vllm")
    assert kept == [0]
    assert logprobs[0].item() == 0.0


def test_exactly_k_on_a_tie_at_the_kth_value_lower_id_first():
    # logits [1, 2, 2, 2, 0], k 2: three tokens tie at 2; DeepInfer keeps exactly two, ids 1 and 2
    kept, logprobs = _kept([1.0, 2.0, 2.0, 2.0, 0.0], top_k=2)
    assert kept == [1, 2]
    torch.testing.assert_close(logprobs[1:3], torch.full((2,), math.log(0.5)))
    # the vLLM order keeps every tie: ids 1, 2 and 3, a third each
    kept, logprobs = _kept([1.0, 2.0, 2.0, 2.0, 0.0], top_k=2, filter_order="vllm")
    assert kept == [1, 2, 3]
    torch.testing.assert_close(logprobs[1:4], torch.full((3,), math.log(1 / 3)))


def test_a_tie_at_the_kth_value_follows_the_ids_not_the_positions_among_the_ties():
    # the tie at 2 sits at ids 3, 0 and 4 (ranked by id: 0, 3, 4); k 3 keeps id 1 (logit 5), then 0 and 3
    kept, _ = _kept([2.0, 5.0, 1.0, 2.0, 2.0], top_k=3)
    assert kept == [0, 1, 3]


def test_top_p_keeps_the_token_whose_preceding_mass_equals_it():
    # p = [1/2, 1/4, 1/8, 1/8] (exact in float32), top_p 3/4: token 2 has exactly 3/4 before it and
    # stays (preceding mass <= top_p, not <); token 3, its tie, has 7/8 before it
    logits = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    assert _kept(logits, top_p=0.75)[0] == [0, 1, 2]
    # the vLLM order stops at the shortest prefix reaching 3/4
    assert _kept(logits, top_p=0.75, filter_order="vllm")[0] == [0, 1]


def test_top_p_cuts_a_tie_by_id():
    # p = [.4, .2, .2, .2], top_p .5: token 1 crosses .5 and stays; tokens 2 and 3, tied with it,
    # have .6 and .8 before them. The vLLM order keeps all three tied tokens.
    logits = [math.log(0.4), math.log(0.2), math.log(0.2), math.log(0.2)]
    assert _kept(logits, top_p=0.5)[0] == [0, 1]
    assert _kept(logits, top_p=0.5, filter_order="vllm")[0] == [0, 1, 2, 3]


def test_the_first_token_is_always_kept():
    # top_p far below the largest probability still keeps the top token, and only the lower id of a top tie
    assert _kept(P_532, top_p=1e-7)[0] == [0]
    assert _kept([3.0, 1.0, 3.0], top_p=1e-7)[0] == [0]


@pytest.mark.parametrize("top_p, top_k, kept", [
    (1.0, -1, [0, 1, 2, 3, 4]),  # both off
    (1.0, 5, [0, 1, 2, 3, 4]),  # k at the vocabulary size is off
    (1.0, 0, [0, 1, 2, 3, 4]),  # k <= 0 is off
    (0.3, 4, [0]),  # top-p is the tighter: p = [.4, .3, .15, .1, .05], token 1 has .4 before it
    (0.75, 2, [0, 1]),  # top-k is the tighter: top-p alone keeps [0, 1, 2] (.7 before token 2)
])
def test_the_tighter_filter_decides(top_p, top_k, kept):
    logits = [math.log(p) for p in (0.4, 0.3, 0.15, 0.1, 0.05)]
    assert _kept(logits, top_p=top_p, top_k=top_k)[0] == kept


def test_temperature_applies_before_the_filters():
    # logits log([.5, .3, .2]), top_p .75: at temperature 1 token 2 has .8 before it and goes; at
    # temperature 2, p is proportional to sqrt(.5), sqrt(.3), sqrt(.2) = [.415, .322, .263], token 2
    # has .737 before it and stays
    assert _kept(P_532, top_p=0.75)[0] == [0, 1]
    assert _kept(P_532, top_p=0.75, temperature=2.0)[0] == [0, 1, 2]
