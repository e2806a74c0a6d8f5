"""A prefill step scores its indexer queries in runs of sequences (bounded ``rows x keys``
logits): every row's logits are the ones of one run over the whole step."""
import random

import pytest
import torch

from deepinfer.models.deepseek_v41 import attention
from tests.models.tiny_model import SequenceRunner, tiny_model


def _mixed_steps(monkeypatch, group_elements: int) -> list[torch.Tensor]:
    """Prefill chunks of five sequences, then a step mixing decodes, chunk continuations and a
    new prompt; all logits rows of both steps."""
    monkeypatch.setattr(attention, "INDEXER_GROUP_ELEMENTS", group_elements)
    model, rng = tiny_model(seed=3), random.Random(0)
    runner = SequenceRunner(model, num_seqs=6, max_len=256)
    tokens = {s: [rng.randrange(3, 500) for _ in range(rng.randint(20, 90))] for s in range(5)}
    first = runner.step({s: t[:len(t) // 2] for s, t in tokens.items()}, all_logits=True)
    second = runner.step({**{s: t[len(t) // 2:] for s, t in tokens.items() if s % 2},
                          **{s: t[len(t) // 2:len(t) // 2 + 1] for s, t in tokens.items() if not s % 2},
                          5: [rng.randrange(3, 500) for _ in range(40)]}, all_logits=True)
    return [first, second]


def test_runs_of_sequences_give_the_whole_step_logits(monkeypatch):
    whole = _mixed_steps(monkeypatch, 1 << 40)
    calls = []
    groups = attention.Attention._indexer_groups
    monkeypatch.setattr(attention.Attention, "_indexer_groups",
                        lambda self, ctx: calls.append(groups(self, ctx)) or calls[-1])
    split = _mixed_steps(monkeypatch, 1)
    assert max(len(g) for g in calls) == 6, "with a budget of one element every sequence is its own run"
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget, runs", [(1, 3), (10 * 15, 1), (70, 2), (60, 2)])
def test_runs_keep_to_the_budget_and_to_sequence_order(budget, runs, monkeypatch):
    monkeypatch.setattr(attention, "INDEXER_GROUP_ELEMENTS", budget)
    layer = next(layer.attn for layer in tiny_model().layers if layer.attn.ratio == 2)
    ctx = type("Ctx", (), {"query_lens_host": (4, 3, 3), "context_lens_host": (10, 10, 10), "num_tokens": 10})
    groups = layer._indexer_groups(ctx)
    assert len(groups) == runs
    assert groups[0][0] == 0 and groups[-1][1] == 10 and groups[-1][3] == 15
    assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(groups, groups[1:]))


def test_long_prompts_are_scored_in_runs_that_waste_little():
    """Sixteen 512-token prompts: the runs' dense logits stay within the waste bound of what their
    rows need, instead of one run scoring every query against every prompt's keys."""
    layer = next(layer.attn for layer in tiny_model().layers if layer.attn.ratio == 2)
    ctx = type("Ctx", (), {"query_lens_host": (512,) * 16, "context_lens_host": (512,) * 16, "num_tokens": 8192})
    groups = layer._indexer_groups(ctx)
    assert groups[0][0] == 0 and groups[-1][1] == 8192 and groups[-1][3] == 16 * 256
    assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(groups, groups[1:]))
    for t0, t1, k0, k1 in groups:
        sequences = (t1 - t0) // 512
        needed = sequences * 512 * 256
        assert (t1 - t0) * (k1 - k0) <= max(attention.INDEXER_GROUP_WASTE * needed, attention.INDEXER_SMALL_GROUP)
    assert sum((t1 - t0) * (k1 - k0) for t0, t1, k0, k1 in groups) < 8192 * 4096 / 4


def _short_prompt_steps(fit) -> tuple[list[torch.Tensor], list[bool]]:
    """Two prefill chunks and two decode steps of three sequences whose compressed keys stay within
    ``index_topk`` (at most 46 keys, at ratio 1, of 48) in prefill, with ``fit`` deciding the shortcut;
    every step's logits rows and each indexer call's shortcut."""
    model, rng = tiny_model(seed=5, index_topk=48), random.Random(1)
    runner = SequenceRunner(model, num_seqs=3, max_len=64)
    tokens = {s: [rng.randrange(3, 500) for _ in range(rng.randint(30, 46))] for s in range(3)}
    taken = []

    def deciding(self, ctx):
        taken.append(fit(self, ctx))
        return taken[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention.Attention, "_windows_fit_topk", deciding)
        logits = [runner.step({s: t[:17] for s, t in tokens.items()}, all_logits=True),
                  runner.step({s: t[17:] for s, t in tokens.items()}, all_logits=True)]
        for _ in range(2):
            logits.append(runner.step({s: [rng.randrange(3, 500)] for s in tokens}, decode=True))
    return logits, taken


def test_prefill_skips_the_indexer_when_every_window_fits_topk_with_the_same_logits():
    """Top-k of a window no longer than k is the whole window: the shortcut's selection gives the
    logits of the scored one, bit for bit, and is taken by every compressed layer's prefill."""
    fitting = attention.Attention._windows_fit_topk
    shortcut, taken = _short_prompt_steps(fitting)
    scored, _ = _short_prompt_steps(lambda self, ctx: False)
    assert taken and all(taken), "every prefill chunk's windows fit index_topk"
    for a, b in zip(shortcut, scored):
        assert torch.equal(a, b)


def test_prefill_runs_the_indexer_once_a_sequence_holds_more_than_topk_keys():
    layer = next(layer.attn for layer in tiny_model(index_topk=8).layers if layer.attn.ratio == 2)
    fits = type("Ctx", (), {"context_lens_host": (16, 5)})
    longer = type("Ctx", (), {"context_lens_host": (5, 18)})
    assert layer._windows_fit_topk(fits) and not layer._windows_fit_topk(longer)
