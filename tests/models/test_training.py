"""The training forward against the inference forward, and the training helpers."""
import pytest
import torch

from deepinfer.models.deepseek_v41.training import (TrainingForward, balance_gate_biases, check_training_length,
                                                    draft_objective)
from deepinfer.models.forward_context import ForwardContext
from tests.models.tiny_model import SequenceRunner, tiny_config, tiny_model

LENGTH = 32
NOISE = 511


@pytest.fixture(scope="module")
def model():
    return tiny_model(index_topk=LENGTH)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 500, (2, LENGTH), generator=torch.Generator().manual_seed(0))


def _prefill_logits(model, tokens):
    return SequenceRunner(model, 1, 2 * LENGTH).step({0: tokens.tolist()}, all_logits=True)


def test_training_logits_match_a_full_prefill(model, ids):
    """Same logits as the cache-based prefill: with keys rounded to the cache formats the gap is
    float accumulation order (and the rare FP8 rounding flip it causes); without rounding it is
    the KV-cache rounding, far larger, so the tolerance below could not hide a rounding mistake."""
    with torch.no_grad():
        rounded = TrainingForward(model, LENGTH).target(ids).logits
        exact = TrainingForward(model, LENGTH, round_kv=False).target(ids).logits
    for b in range(len(ids)):
        reference = _prefill_logits(model, ids[b])
        error = (rounded[b] - reference).abs()
        assert error.max() < 5e-3 and error.mean() < 5e-4, (error.max().item(), error.mean().item())
        assert (exact[b] - reference).abs().mean() > 1e-2


@pytest.mark.parametrize("drafts", [(1, None), (3, None), (3, False)], ids=["one", "three_shifted", "three_hc_head"])
def test_draft_pass_matches_inference_draft_forward(model, ids, drafts):
    """Draft rows of anchor n equal ``draft_forward`` after a prefill of the first n tokens, with
    one or three draft layers, shifted or with an HC head."""
    layers, shifted = drafts
    if layers > 1:
        model = tiny_model(index_topk=LENGTH, num_nextn_predict_layers=layers, dspark_hc_shifted=shifted)
    block, anchor = 5, 20
    runner = SequenceRunner(model, 1, 2 * LENGTH)
    ctx = ForwardContext.for_sequences([ids[0, :anchor].tolist()], [0], [1], [runner.blocks(0)])
    ctx.write_draft_cache = True
    with torch.no_grad():
        model(ctx, runner.caches)
        ctx = ForwardContext.for_sequences([[int(ids[0, anchor])] + [NOISE] * (block - 1)], [anchor], [1],
                                           [runner.blocks(0)], decode=True)
        ctx.draft_block = block
        logits, hidden = model.draft_forward(ctx, runner.caches)
        trainer = TrainingForward(model, LENGTH)
        features = trainer.target(ids).features
        anchors = torch.tensor([[anchor, 3], [1, 26]])
        train_logits, train_hidden = trainer(ids, (features, anchors, block, NOISE))
    torch.testing.assert_close(train_logits[0, 0], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(train_hidden[0, 0], hidden, atol=1e-4, rtol=1e-4)


def test_gradients_reach_every_backbone_weight_the_forward_uses(ids):
    model = tiny_model(index_topk=LENGTH)
    for p in model.parameters():
        p.requires_grad_(True)
    logits = TrainingForward(model, LENGTH).target(ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    unused = ("indexer.", "mtp.", "gate.bias")
    for name, p in model.named_parameters():
        if any(part in name for part in unused):
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_training_length_must_fit_index_topk():
    with pytest.raises(ValueError, match="index_topk=8 is below the 32 compressed keys"):
        check_training_length(tiny_config(index_topk=8), 32)
    with pytest.raises(ValueError, match="multiple of every compression ratio"):
        check_training_length(tiny_config(index_topk=64), 33)


def test_balance_step_moves_biases_toward_underloaded_experts():
    model = tiny_model()
    moe = model.layers[0].ffn
    moe.gate.bias.zero_()
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])  # loads 3, 2, 1 and 0 elsewhere; mean 0.75
    balance_gate_biases([moe], [ids], rate=0.5)
    expected = torch.full((moe.num_experts,), 0.5)
    expected[:3] = -0.5
    torch.testing.assert_close(moe.gate.bias.detach(), expected)


def test_draft_objective_of_a_drafter_that_copies_the_target():
    """Draft logits equal to the target's (after the Markov correction) accept with certainty:
    acceptance 1 per position, every draft accepted greedily, distillation = target entropy."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    previous = torch.randint(3, 500, (2, 3, 4), generator=gen)
    target = torch.randn(2, 3, 4, model.cfg.vocab_size, generator=gen)
    _, correction = model.mtp[-1].markov(previous.reshape(-1))
    draft = target - correction.view_as(target)
    hidden = torch.randn(2, 3, 4, model.cfg.hidden_size, generator=gen)
    objective = draft_objective(model, draft, hidden, previous, target)
    torch.testing.assert_close(objective.acceptance, torch.ones(4), atol=1e-5, rtol=0)
    assert objective.greedy_accepted_length == 4.0
    q = torch.softmax(target, -1)
    torch.testing.assert_close(objective.distill, -(q * q.log()).sum(-1).mean(), atol=1e-4, rtol=1e-4)
