"""DSpark verification accepts drafts against the target distribution filtered in
``decoding.filter_order``: :func:`~deepinfer.decoding.sampler.emit` with one draft per request."""
import math

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.decoding.sampler import emit
from deepinfer.engine.device import Runtime
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Chunk
from deepinfer.hal import OpTable

P_532 = [math.log(0.5), math.log(0.3), math.log(0.2)]


def _verify_token_1(filter_order: str, count: int = 200):
    """``count`` requests (seeds 0..count-1) each verifying draft token 1, drawn from a draft
    distribution that is sure of it, against target logits log([.5, .3, .2]) at temperature 1,
    top_p .6, top_k 2; returns each request's emitted tokens and accept count."""
    params = SamplingParams(temperature=1.0, top_p=0.6, top_k=2, max_tokens=4)
    chunks = []
    for seed in range(count):
        request = Request(seed, None, [5, 6], params, seed)
        request.draft_logprobs = torch.tensor([[-math.inf, 0.0, -math.inf]])
        chunks.append(Chunk(request, [6, 1], start=1, samples=True, drafts=[1], slot=seed))
    logits = torch.tensor([P_532, P_532] * count)  # per request: the draft's row, then the final row
    emissions = emit(OpTable("reference"), Runtime(torch.device("cpu")), chunks, logits,
                     filter_order=filter_order).collect()
    return [e.tokens for e in emissions], sum(e.accepted for e in emissions)


def test_deepinfer_order_accepts_a_draft_that_top_p_on_the_full_softmax_keeps():
    # top-p .6 on [.5, .3, .2] keeps {0, 1} (token 1 has .5 before it), top-k 2 keeps both:
    # q = [5/8, 3/8, 0], so a sure draft of token 1 is accepted with chance 3/8
    tokens, accepted = _verify_token_1("deepinfer")
    assert 0.25 * 200 < accepted < 0.5 * 200, accepted
    assert all(t[0] in (0, 1) for t in tokens)
    assert all(t == [1, t[1]] for t in tokens if len(t) == 2), "an accepted draft is followed by the final row's token"


def test_vllm_order_rejects_it_and_resamples_from_what_it_keeps():
    # top-k 2 keeps {0, 1}, renormalised [5/8, 3/8]; top-p .6 keeps {0}: q(1) = 0, never accepted,
    # and the residual max(q - alpha p, 0) is token 0 alone
    tokens, accepted = _verify_token_1("vllm")
    assert accepted == 0
    assert tokens == [[0]] * 200


def test_an_unknown_order_is_refused_before_sampling():
    with pytest.raises(ValueError, match=r"filter_order='nucleus_first' is not a filter order; use one of "
                                         r"\['deepinfer', 'vllm'\]"):
        _verify_token_1("nucleus_first", count=1)
