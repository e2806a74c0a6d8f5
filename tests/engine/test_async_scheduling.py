"""Asynchronous scheduling: decode step N+1 is scheduled and launched before step N is
collected, its input tokens filled in on the device. Every output matches the synchronous
engine's, requests that stop while a step is in flight drop that step's row and keep their
cache until it is collected, and the overlap really happens."""
import gc
import importlib.util

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_manager import KVManager

QUIET = ["engine.use_tqdm=false"]
PROMPTS = [[5, 17, 99, 230, 41], [300, 12], list(range(40, 75)), [7] * 9, [120, 121, 122], [64, 65],
           list(range(200, 260)), list(range(3, 128))]


def _params():
    """Greedy, seeded sampling with logprobs, a stop token hit mid-generation, varied lengths."""
    return [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, max_tokens=11, seed=3, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=9, seed=11, stop_token_ids=list(range(3, 200))),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.7, max_tokens=16, seed=5, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=12, seed=8, stop_token_ids=list(range(100, 400))),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0.8, max_tokens=10, seed=2)]


def _generate(overrides, monkeypatch=None):
    llm = LLM("tiny_random", "reference", QUIET + ["engine.max_num_seqs=4"] + overrides)
    overlapped = []
    if monkeypatch is not None:
        can_overlap = type(llm)._can_overlap
        monkeypatch.setattr(llm, "_can_overlap", lambda step: overlapped.append(can_overlap(llm, step)) or
                            overlapped[-1])
    outputs = llm.generate(PROMPTS, _params())
    return llm, outputs, sum(overlapped)


def _same(got, want):
    """Same tokens, stops and text; log-probabilities to float32 rounding (a step in flight can
    hold a row the synchronous engine no longer runs, so batch shapes differ)."""
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("extra", [[], ["engine.cuda_graphs=true"]], ids=["eager", "padded"])
def test_async_scheduling_emits_the_synchronous_outputs(monkeypatch, extra):
    _, want, _ = _generate(["engine.async_scheduling=false"] + extra)
    llm, got, overlapped = _generate(["engine.async_scheduling=true"] + extra, monkeypatch)
    _same(got, want)
    assert overlapped > 5, "no decode step stayed in flight: the asynchronous path went untested"
    assert any(o.finish_reason == "stop" for o in got), "no request stopped on a token mid-batch"
    assert llm._inflight is None
    assert len(llm.scheduler.kv.free_blocks) == llm.scheduler.kv.num_blocks - 1, "blocks leaked"


def test_preemption_under_async_scheduling_gives_the_synchronous_outputs():
    """Nine usable blocks for 8 requests that each grow past one block: steps run with the
    cache too full to overlap, preemptions happen, outputs match."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(120 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for mode in ("false", "true"):
        llm = LLM("tiny_random", "reference", QUIET + ["engine.num_kv_blocks=10", "engine.max_num_seqs=8",
                                                       f"engine.async_scheduling={mode}"])
        outputs[mode] = llm.generate(prompts, params)
        assert llm.scheduler.num_preemptions > 0, "the cache budget did not force a preemption"
        assert len(llm.scheduler.kv.free_blocks) == 9
    assert [o.token_ids for o in outputs["true"]] == [o.token_ids for o in outputs["false"]]


def test_a_stopped_request_keeps_its_cache_until_its_last_step_is_collected(monkeypatch):
    llm = LLM("tiny_random", "reference", QUIET + ["engine.max_num_seqs=4", "engine.async_scheduling=true"])
    released, early = [], []
    release = KVManager.release

    def checked(self, request):
        launched = llm._inflight
        if launched is not None and any(c.request is request for c in launched.batch.chunks):
            early.append(request.request_id)
        released.append(request.request_id)
        release(self, request)

    monkeypatch.setattr(KVManager, "release", checked)
    outputs = llm.generate(PROMPTS, _params())
    assert not early, f"requests {early} lost their cache while a launched step still wrote there"
    assert sorted(released) == sorted(o.request_id for o in outputs)
    assert any(o.finish_reason == "stop" for o in outputs)


def test_varlen_dspark_and_grammar_steps_are_collected_before_the_next(monkeypatch):
    """Steps whose next inputs need the host (verify lengths chosen from the drafts'
    confidences, masks to fill) never overlap, and give the synchronous tokens."""
    from deepinfer.decoding.dspark import DSpark
    from deepinfer.decoding.verify_schedule import StepTimeCurve

    curve = StepTimeCurve([1, 64], [0.010, 0.013])  # a fixed curve: lengths do not follow this machine's timing
    monkeypatch.setattr(DSpark, "measure_step_time", lambda self, rows: curve)
    overrides = ["decoding=dspark", "decoding.varlen=true", "engine.cuda_graphs=true",
                 "decoding.verify_cost=measured"]  # the curve as it is, with no slope learnt from live steps
    _, want, _ = _generate(["engine.async_scheduling=false"] + overrides)
    _, got, overlapped = _generate(["engine.async_scheduling=true"] + overrides, monkeypatch)
    _same(got, want)
    assert overlapped == 0


DSPARK = ["decoding=dspark", "decoding.varlen=false", "engine.cuda_graphs=true", "engine.max_num_seqs=4"]


def _dspark_params(count):
    """Greedy and seeded sampling, stops on tokens, lengths that end near and far from a step's
    worst case (so both overlapped and collected steps end requests)."""
    kinds = [dict(temperature=0, max_tokens=40, ignore_eos=True),
             dict(temperature=0.8, top_p=0.95, max_tokens=33, seed=4, ignore_eos=True, logprobs=1),
             dict(temperature=0, max_tokens=7, ignore_eos=True),
             dict(temperature=1.0, max_tokens=45, seed=9, stop_token_ids=list(range(30, 60)))]
    return [SamplingParams(**kinds[i % len(kinds)]) for i in range(count)]


def _dspark_generate(mode, prompts, monkeypatch=None, runtime=None):
    import deepinfer.engine.llm as llm_module

    with pytest.MonkeyPatch.context() as patch:
        if runtime is not None:
            patch.setattr(llm_module, "make_runtime", runtime)
        llm = LLM("tiny", "reference", QUIET + DSPARK + [f"engine.async_scheduling={mode}"])
    overlapped = []
    if monkeypatch is not None:
        can_overlap = type(llm)._can_overlap
        monkeypatch.setattr(llm, "_can_overlap", lambda step: overlapped.append(can_overlap(llm, step)) or
                            overlapped[-1])
    return llm, llm.generate(prompts, _dspark_params(len(prompts))), sum(overlapped)


@pytest.fixture(scope="module")
def heldout_prompts():
    """Prompts from the shipped model's held-out text: its drafts are accepted often, so steps
    in flight end at every accepted length."""
    import json

    from deepinfer.models.registry import model_preset, resolve_checkpoint

    sample = json.loads((resolve_checkpoint(model_preset("tiny")["checkpoint"]) / "heldout_sample.json").read_text())
    return sample["prompts"][:6]


def test_dspark_verify_steps_overlap_and_emit_the_synchronous_outputs(monkeypatch, heldout_prompts):
    """With fixed verify lengths, verify step N+1 is launched before step N is collected: its
    golden token, drafts and start position are read on the device from what step N and its
    draft pass left there. Tokens, stops, drafts verified and accepted all match the
    synchronous engine's."""
    _, want, _ = _dspark_generate("false", heldout_prompts)
    llm, got, overlapped = _dspark_generate("true", heldout_prompts, monkeypatch)
    _same(got, want)
    assert [o.verify_log for o in got] == [o.verify_log for o in want]
    assert overlapped > 10, "no verify step stayed in flight: the chained path went untested"
    accepted = {a for o in got for _, a in o.verify_log}
    assert {0, 5} <= accepted and len(accepted) >= 4, f"accepted lengths {accepted}: too few kinds exercised"
    assert any(o.finish_reason == "stop" for o in got) and any(o.finish_reason == "length" for o in got)
    assert llm._inflight is None
    assert len(llm.scheduler.kv.free_blocks) == llm.scheduler.kv.num_blocks - 1, "blocks leaked"
    assert all(r.unconfirmed == 0 and r.pending_drafts == 0 for r in llm.scheduler.running), "counts leaked"


def test_dspark_on_a_slow_threaded_device_overlaps_and_matches(monkeypatch, heldout_prompts):
    from deepinfer.engine.device import ThreadedCpuRuntime

    _, want, _ = _dspark_generate("false", heldout_prompts[:4])
    _, got, overlapped = _dspark_generate("true", heldout_prompts[:4], monkeypatch,
                                          runtime=lambda device: ThreadedCpuRuntime(device, delay_s=0.01))
    _same(got, want)
    assert [o.verify_log for o in got] == [o.verify_log for o in want]
    assert overlapped > 5


def test_on_a_slow_threaded_device_the_host_works_while_steps_compute(monkeypatch):
    """The device work runs on a worker thread and each step is made slow: the host collects
    step N while step N+1 is still computing, and the outputs stay the synchronous ones."""
    import deepinfer.engine.llm as llm_module
    from deepinfer.engine.device import ThreadedCpuRuntime

    _, want, _ = _generate(["engine.async_scheduling=false"])
    monkeypatch.setattr(llm_module, "make_runtime", lambda device: ThreadedCpuRuntime(device, delay_s=0.02))
    llm = LLM("tiny_random", "reference", QUIET + ["engine.max_num_seqs=4", "engine.async_scheduling=true"])
    collect, overlapped = llm._collect, []

    def watching(step, stats):
        launched = llm._inflight
        overlapped.append(launched is not None and launched is not step and not launched.pending.__self__.done())
        collect(step, stats)

    monkeypatch.setattr(llm, "_collect", watching)
    _same(llm.generate(PROMPTS, _params()), want)
    assert sum(overlapped) > 5, "the host never collected a step while the next one computed"


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="the sm100 backend needs tilelang")
@pytest.mark.parametrize("decoding", [[], ["decoding=dspark", "decoding.varlen=false"]], ids=["plain", "dspark"])
def test_async_scheduling_emits_the_synchronous_outputs_on_the_gpu(monkeypatch, decoding):
    """In batch-invariant mode: a step in flight can hold a row the synchronous engine no longer
    runs, so the two engines run different batch shapes, whose bf16 logits differ otherwise.
    With DSpark (CUDA graphs: verify steps chained on the device) the requests run long enough
    for verify steps to overlap."""
    params = _dspark_params(len(PROMPTS)) if decoding else _params()
    outputs, overlapped = [], []
    for mode in ("false", "true"):
        llm = LLM("tiny", "sm100", QUIET + decoding + ["engine.max_num_seqs=4", "backend.fallback=reference",
                                            "model.dtype=bfloat16", "engine.gpu_memory_utilization=0.15",
                                            "engine.batch_invariant=true", f"engine.async_scheduling={mode}"])
        can_overlap = type(llm)._can_overlap
        monkeypatch.setattr(llm, "_can_overlap", lambda step, llm=llm: overlapped.append(can_overlap(llm, step)) or
                            overlapped[-1])
        outputs.append([(o.token_ids, o.finish_reason, o.verify_log) for o in llm.generate(PROMPTS, params)])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert sum(overlapped) > 5, "no decode step stayed in flight: the asynchronous path went untested"
    assert outputs[1] == outputs[0]
