"""Padded decode, verify and draft passes: the sizes they pad to, and the same tokens as the
unpadded eager path (on the CPU the padded shapes run eagerly; on a GPU from CUDA graphs)."""
import gc
import importlib.util

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.graphs import PaddedPass, graph_batch_sizes, graph_table_widths

QUIET = ["engine.use_tqdm=false"]
PROMPTS = [[5, 17, 99, 230, 41], [300, 12], list(range(40, 75)), [7] * 9, [120, 121, 122]]


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]), (5, [1, 2, 4, 5]), (16, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64])])
def test_padded_batch_sizes(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


@pytest.mark.parametrize("table_width, widths", [
    (9, [9]), (16, [16]), (33, [16, 33]), (1025, [16, 64, 256, 1024, 1025])])
def test_table_widths(table_width, widths):
    assert graph_table_widths(table_width) == widths


def test_a_step_runs_at_the_narrowest_table_that_holds_its_sequences(monkeypatch):
    """Short sequences decode with 16-block tables; once one holds 17 blocks the step takes the
    full width; tokens match the unpadded engine either way."""
    widths, call = [], PaddedPass.__call__
    monkeypatch.setattr(PaddedPass, "__call__", lambda self, count, arrays: widths.append(self.fields["table"]) or
                        call(self, count, arrays))
    prompts = [[5, 17, 99], list(range(3, 500)) * 4 + list(range(3, 40))]  # 3 and 2,025 tokens (16 blocks)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for graphs in ("false", "true"):
        llm = LLM("tiny", "reference", QUIET + ["model.max_model_len=4096", f"engine.cuda_graphs={graphs}"])
        outputs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["true"] == outputs["false"]
    assert sorted(set(widths)) == [16, 33] and widths[0] == 16 and widths[-1] == 33


def _params():
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=9, seed=11, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.7, max_tokens=12, seed=5, ignore_eos=True)]


def _run(overrides, backend="reference"):
    llm = LLM("tiny", backend, QUIET + ["engine.max_num_seqs=6"] + overrides)
    llm.runner.logits_trace = {}
    outputs = llm.generate(PROMPTS, _params())
    return llm, outputs


@pytest.mark.parametrize("decoding", [[], ["decoding=dspark", "decoding.varlen=false"]], ids=["plain", "dspark"])
def test_padded_steps_emit_the_unpadded_tokens(decoding):
    eager, want = _run(["engine.cuda_graphs=false"] + decoding)
    padded, got = _run(["engine.cuda_graphs=true"] + decoding)
    assert padded.runner.passes and not eager.runner.passes
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.num_accepted == w.num_accepted
    for rid, steps in eager.runner.logits_trace.items():
        for a, b in zip(steps, padded.runner.logits_trace[rid]):
            torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    if decoding:
        assert sum(o.num_accepted for o in got) > 0, "no draft was accepted: the verify pass went untested"


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="the sm100 backend needs tilelang")
@pytest.mark.parametrize("decoding", [[], ["decoding=dspark", "decoding.varlen=false"]], ids=["plain", "dspark"])
def test_graphed_steps_emit_the_eager_tokens_on_the_gpu(decoding):
    """Each engine takes its share of the card's memory for its KV cache, so one is freed
    before the next starts."""
    common = ["backend.fallback=reference", "model.dtype=bfloat16", "engine.gpu_memory_utilization=0.15"] + decoding
    tokens, graphed = [], []
    for graphs in ("false", "true"):
        llm, outputs = _run([f"engine.cuda_graphs={graphs}"] + common, "sm100")
        tokens.append([o.token_ids for o in outputs])
        graphed.append(bool(llm.runner.passes) and all(p.graphs for p in llm.runner.passes.values()))
        del llm, outputs
        gc.collect()
        torch.cuda.empty_cache()
    assert graphed == [False, True]
    assert tokens[1] == tokens[0]
