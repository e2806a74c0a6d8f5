"""The draft pass draws from the distribution ``decoding.filter_order`` names."""
import torch

from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.interface import DraftSampling
from tests.models.tiny_model import SequenceRunner, tiny_model

PROMPT = [5, 17, 230, 41, 99, 7, 64, 300, 12, 8, 150, 3]
BLOCK = 3
NOISE = 511


def _kept(probs: torch.Tensor, top_p: torch.Tensor, top_k: int, order: str) -> torch.Tensor:
    """Hand-written float64 filters, row by row. ``deepinfer``: top-p over the full distribution
    (a token stays while the mass ranked before it is below ``top_p``), then the ``top_k`` best by
    rank. ``vllm``: the ``top_k`` best, renormalised, then top-p."""
    kept = torch.zeros_like(probs, dtype=torch.bool)
    for row, p in enumerate(probs.double()):
        ranked = torch.sort(p, descending=True, stable=True)
        mass = ranked.values if order == "deepinfer" else ranked.values[:top_k] / ranked.values[:top_k].sum()
        before = torch.cumsum(mass, 0) - mass
        count = min(int((before < top_p[row]).sum()), top_k)
        kept[row, ranked.indices[:count]] = True
    return kept


def _draft(model, top_p: torch.Tensor, top_k: int, order: str, confidence_temperature=1.0):
    runner = SequenceRunner(model, 2, 64)
    runner.step({0: PROMPT, 1: PROMPT[::-1]})
    ctx = ForwardContext.for_sequences([[PROMPT[-1]] + [NOISE] * (BLOCK - 1), [PROMPT[0]] + [NOISE] * (BLOCK - 1)],
                                       [len(PROMPT)] * 2, [1, 2], [runner.blocks(0), runner.blocks(1)], decode=True)
    ctx.draft_block = BLOCK
    sampling = DraftSampling(torch.ones(2), top_p, torch.full((2,), top_k), torch.tensor([1, 2]),
                             confidence_temperature, order)
    with torch.no_grad():
        return model.draft(ctx, runner.caches, sampling)


def test_draft_tokens_come_from_the_configured_filter_order():
    """Top-2 with a top-p between p1 and p1 / (p1 + p2) keeps two tokens in DeepInfer's order and
    one in vLLM's, so the orders disagree on every row of the first draft position."""
    model = tiny_model(seed=3)
    full = _draft(model, torch.ones(2), 0, "deepinfer").logprobs[:, 0].exp()
    top = torch.sort(full.double(), dim=-1, descending=True).values
    top_p = ((top[:, 0] + top[:, 0] / (top[:, 0] + top[:, 1])) / 2).float()
    for order in ("deepinfer", "vllm"):
        proposal = _draft(model, top_p, 2, order)
        expected = _kept(full, top_p, 2, order)
        assert torch.equal(proposal.logprobs[:, 0].isfinite(), expected), order
        assert expected[torch.arange(2), proposal.tokens[:, 0]].all()
    assert not torch.equal(_kept(full, top_p, 2, "deepinfer"), _kept(full, top_p, 2, "vllm"))


def test_each_draft_step_takes_its_own_confidence_temperature():
    """With temperatures T_i per step, step i's confidence is sigmoid(score_i / T_i), where
    score_i = logit(the confidence at T = 1); the drafts themselves do not change."""
    model = tiny_model(seed=3)
    plain = _draft(model, torch.ones(2), 0, "deepinfer")
    temperatures = (0.5, 2.0, 4.0)
    scaled = _draft(model, torch.ones(2), 0, "deepinfer", temperatures)
    assert torch.equal(plain.tokens, scaled.tokens)
    scores = torch.logit(plain.confidences.double())
    want = torch.sigmoid(scores / torch.tensor(temperatures, dtype=torch.float64))
    assert torch.allclose(scaled.confidences.double(), want, atol=1e-6)
