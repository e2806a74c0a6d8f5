"""No host synchronisation while a step is launched: every way a tensor value (or a shape that
depends on values) can reach the host is counted while the engine launches its decode and
verify steps (forward and sampling) and runs its draft passes, and a whole engine step copies
results down exactly once per pass that needs them."""
import contextlib
import importlib.util

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.device import Runtime

QUIET = ["engine.use_tqdm=false"]
READS = ["item", "tolist", "numpy", "nonzero", "masked_select", "unique", "__bool__", "__int__", "__float__",
         "__index__"]
"""Tensor methods that read values on the host or size their output from them."""


@contextlib.contextmanager
def count_host_reads(monkeypatch):
    """Counts every call of :data:`READS`, bool-mask indexing and ``repeat_interleave`` without
    ``output_size``, as ``(name, count)`` in the yielded dict."""
    counts: dict[str, int] = {}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)
        return wrapper

    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        for name in ("nonzero", "masked_select", "unique"):
            patch.setattr(torch, name, counting(f"torch.{name}", getattr(torch, name)))
        getitem, repeat = torch.Tensor.__getitem__, torch.repeat_interleave

        def indexing(self, index):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                counts["bool mask index"] = counts.get("bool mask index", 0) + 1
            return getitem(self, index)

        def repeat_interleave(*args, **kwargs):
            if isinstance(args[0], torch.Tensor) and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                    and kwargs.get("output_size") is None:
                counts["repeat_interleave"] = counts.get("repeat_interleave", 0) + 1
            return repeat(*args, **kwargs)

        patch.setattr(torch.Tensor, "__getitem__", indexing)
        patch.setattr(torch, "repeat_interleave", repeat_interleave)
        yield counts


def test_the_counter_sees_each_kind_of_host_read(monkeypatch):
    x = torch.arange(6.0)
    with count_host_reads(monkeypatch) as counts:
        x[2].item(), x.tolist(), bool(x[1]), x.nonzero(), torch.nonzero(x), x[x > 2]
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1, 1, 1]))
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1, 1, 1]), output_size=6)
    assert counts == {"item": 1, "tolist": 1, "__bool__": 1, "nonzero": 1, "torch.nonzero": 1,
                      "bool mask index": 1, "repeat_interleave": 1}


@pytest.mark.parametrize("graphs", ["false", "true"])
@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_decode_launches_read_nothing_on_the_host(monkeypatch, graphs, dspark):
    decoding = ["decoding=dspark", "decoding.varlen=false"] if dspark else []
    llm = LLM("tiny", "reference", QUIET + [f"engine.cuda_graphs={graphs}"] + decoding)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=1, ignore_eos=True)
    for prompt in ([5, 17, 99, 230], [300, 12, 7]):
        llm.add_request(prompt, params)
    llm.step()  # prefill (and the first draft pass)
    launch, draft = llm._launch, llm.runner.draft
    seen = {}

    def launching(batch, stats):
        with count_host_reads(monkeypatch) as counts:
            launched = launch(batch, stats)
        seen.setdefault("decode" if batch.decode else "other", []).append(dict(counts))
        return launched

    def draft_pass(requests):
        with count_host_reads(monkeypatch) as counts:
            proposal = draft(requests)
        seen.setdefault("draft", []).append(dict(counts))
        return proposal

    monkeypatch.setattr(llm, "_launch", launching)
    monkeypatch.setattr(llm.runner, "draft", draft_pass)
    downloads = []
    original_download = Runtime.start_download
    monkeypatch.setattr(Runtime, "start_download",
                        lambda self, t: downloads.append(t.shape) or original_download(self, t))
    for _ in range(3):
        stats = llm.step()
        assert stats.decode and stats.num_decode_tokens == 2 * (1 + (llm.dspark.k if dspark else 0))
    assert seen["decode"] == [{}] * 3, f"host reads while decode steps launch: {seen['decode']}"
    if dspark:
        assert seen["draft"] == [{}] * 3, f"host reads inside draft passes: {seen['draft']}"
    assert len(downloads) == 3 * (2 if dspark else 1), "one copy down per step (plus one per draft pass)"


def test_value_checks_stay_on_outside_the_engine():
    """A forward called directly still checks its inputs (the engine skips the checks)."""
    from deepinfer.models.forward_context import ForwardContext

    llm = LLM("tiny_random", "reference", QUIET)
    ctx = ForwardContext.for_sequences([[llm.model.vocab_size + 3]], [0], [1], [[1]])
    with pytest.raises(ValueError, match="token ids must be in"), torch.no_grad():
        llm.model(ctx, llm.runner.caches)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="the sm100 backend needs tilelang")
def test_graphed_decode_step_launches_without_synchronisation_on_the_gpu():
    """CUDA's sync debug mode raises on any synchronising call: launching a graphed decode step
    (inputs up, forward, sampling, the copy of its results started) makes none; the host waits
    only when it collects the step."""
    llm = LLM("tiny", "sm100", QUIET + ["backend.fallback=reference", "model.dtype=bfloat16",
                                        "engine.gpu_memory_utilization=0.15"])
    for prompt in ([5, 17, 99, 230], [300, 12, 7]):
        llm.add_request(prompt, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=4, max_tokens=8,
                                               ignore_eos=True, logprobs=2))
    llm.step()
    launch = llm._launch

    def strict(batch, stats):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch, stats)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    llm._launch = strict
    for _ in range(3):
        assert llm.step().decode
