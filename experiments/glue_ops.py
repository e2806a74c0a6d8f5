"""The torch calls of one engine step that run outside every HAL op (the model's glue: casts,
index arithmetic, concatenations), by the line of deepinfer code that makes them, and the HAL op
calls of the step. On a GPU each
is at least one kernel launch beside the ops' own, so this is the list to fuse away; it runs on
any CPU.

    python experiments/glue_ops.py [study.batch=1] [study.prompt=64] [study.steps=2] [study.prefill=true]
        [overrides...]

Decode steps of ``study.batch`` requests (the composed engine: ``model=tiny backend=reference``
unless overridden) after their prefill (or, with ``study.prefill=true``, their prefill step), run
eagerly; prints the calls per step by source line and aten op, and writes them to
``experiments/results/glue_ops_<decode|prefill>.csv``."""
from __future__ import annotations

import collections
import functools
import sys
import threading
import traceback
from dataclasses import dataclass

from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import LLM, SamplingParams
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

FREE = {"aten.view.default", "aten._unsafe_view.default", "aten.detach.default", "aten.alias.default",
        "aten.empty.memory_format", "aten.empty_strided.default", "aten.t.default", "aten.transpose.int",
        "aten.unsqueeze.default", "aten.squeeze.dim", "aten.expand.default", "aten.slice.Tensor",
        "aten.select.int", "aten.as_strided.default", "aten.permute.default", "aten.split.Tensor",
        "aten.unbind.int", "aten._to_copy.default?", "aten.lift_fresh.default", "aten.reshape.default",
        "aten.split_with_sizes.default", "aten.narrow.default", "aten.view_as_real.default",
        "aten.unflatten.int", "aten.flatten.using_ints", "aten.is_same_size.default", "aten.sym_size.int",
        "aten.empty_like.default"}
"""Metadata-only aten ops (no kernel on a GPU)."""


@dataclass
class Settings(StudySettings):
    """The requests whose steps are counted."""

    FAST = ("study.prompt=16", "study.steps=1")

    batch: int = 1
    """Requests in the step."""
    prompt: int = 64
    """Prompt tokens of each request."""
    steps: int = 2
    """Decode steps counted (their mean per step is printed)."""
    prefill: bool = False
    """Count the prefill step instead of decode steps."""


class GlueCounter(TorchDispatchMode):
    """Counts aten calls made while no HAL op is running, keyed by (deepinfer source line, op)."""

    def __init__(self):
        super().__init__()
        self.inside = threading.local()
        self.counts: collections.Counter = collections.Counter()
        self.op_calls: collections.Counter = collections.Counter()

    def wrap(self, name: str, impl):
        @functools.wraps(impl)
        def call(*args, **kwargs):
            if not getattr(self.inside, "depth", 0):
                self.op_calls[name] += 1
            self.inside.depth = getattr(self.inside, "depth", 0) + 1
            try:
                return impl(*args, **kwargs)
            finally:
                self.inside.depth -= 1
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(self.inside, "depth", 0) and str(func) not in FREE:
            self.counts[(_caller(), str(func))] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/deepinfer/" in f.filename and "/hal/" not in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.split('/deepinfer/')[-1]}:{frame.lineno} {frame.line.strip()[:70]}"


def count_step_calls(llm: LLM, steps: int) -> GlueCounter:
    """The HAL op calls and glue calls of ``llm``'s next ``steps`` steps."""
    counter = GlueCounter()
    saved = dict(llm.ops._impls)
    for name, impl in saved.items():
        llm.ops._impls[name] = counter.wrap(name, impl)
    try:
        with counter:
            for _ in range(steps):
                llm.step()
    finally:
        llm.ops._impls.update(saved)
    return counter


def main(argv=None) -> int:
    app, settings = compose_study("glue_ops", Settings, argv)
    llm = LLM.from_config(app)
    params = SamplingParams(temperature=0, max_tokens=settings.steps + 4, ignore_eos=True)
    for i in range(settings.batch):
        llm.add_request([(7 * i + j) % 100 + 3 for j in range(settings.prompt)], params)
    if not settings.prefill:
        while llm.step().num_prefill_tokens:
            pass
        llm.step()
    steps = 1 if settings.prefill else settings.steps
    counter = count_step_calls(llm, steps)
    total = sum(counter.counts.values()) / steps
    kind = "prefill" if settings.prefill else "decode"
    calls = sum(counter.op_calls.values()) / steps
    print(f"HAL op calls per {kind} step (batch {settings.batch}): {calls:.0f} "
          f"({', '.join(f'{op} {n / steps:g}' for op, n in sorted(counter.op_calls.items()))})")
    print(f"glue calls per {kind} step (batch {settings.batch}): {total:.0f}")
    rows = [{"step": kind, "batch": settings.batch, "kind": "hal_op", "op": op, "where": "", "per_step": n / steps}
            for op, n in sorted(counter.op_calls.items())]
    for (where, op), count in sorted(counter.counts.items(), key=lambda item: (item[0][0], item[0][1])):
        print(f"{count / steps:6.1f}  {op:40s} {where}")
        rows.append({"step": kind, "batch": settings.batch, "kind": "glue", "op": op, "where": where,
                     "per_step": count / steps})
    path = write_results(settings.results_path(f"glue_ops_{kind}"), rows, study_command("glue_ops", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
