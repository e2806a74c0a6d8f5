"""The torch calls of one engine step that run outside every HAL op (the model's glue: casts,
index arithmetic, concatenations), by the line of deepinfer code that makes them, and the HAL op
calls of the step. On a GPU each
is at least one kernel launch beside the ops' own, so this is the list to fuse away; it runs on
any CPU.

    python experiments/glue_ops.py [--batch 1] [--prompt 64] [--steps 2] [--prefill] [overrides ...]

Decode steps of ``--batch`` requests (``model=tiny backend=reference`` unless overridden) after
their prefill (or, with ``--prefill``, their prefill step), run eagerly; prints the calls per
step by source line and aten op."""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import LLM, SamplingParams

FREE = {"aten.view.default", "aten._unsafe_view.default", "aten.detach.default", "aten.alias.default",
        "aten.empty.memory_format", "aten.empty_strided.default", "aten.t.default", "aten.transpose.int",
        "aten.unsqueeze.default", "aten.squeeze.dim", "aten.expand.default", "aten.slice.Tensor",
        "aten.select.int", "aten.as_strided.default", "aten.permute.default", "aten.split.Tensor",
        "aten.unbind.int", "aten._to_copy.default?", "aten.lift_fresh.default", "aten.reshape.default",
        "aten.split_with_sizes.default", "aten.narrow.default", "aten.view_as_real.default",
        "aten.unflatten.int", "aten.flatten.using_ints", "aten.is_same_size.default", "aten.sym_size.int",
        "aten.empty_like.default"}
"""Metadata-only aten ops (no kernel on a GPU)."""


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="count the prefill step instead")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    llm = LLM(overrides=["model=tiny", "backend=reference", *args.overrides])
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    for i in range(args.batch):
        llm.add_request([(7 * i + j) % 100 + 3 for j in range(args.prompt)], params)
    if not args.prefill:
        while llm.step().num_prefill_tokens:
            pass
        llm.step()
    steps = 1 if args.prefill else args.steps
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
    total = sum(counter.counts.values()) / steps
    kind = "prefill" if args.prefill else "decode"
    calls = sum(counter.op_calls.values()) / steps
    print(f"HAL op calls per {kind} step (batch {args.batch}): {calls:.0f} "
          f"({', '.join(f'{op} {n / steps:g}' for op, n in sorted(counter.op_calls.items()))})")
    print(f"glue calls per {kind} step (batch {args.batch}): {total:.0f}")
    for (where, op), count in sorted(counter.counts.items(), key=lambda item: (item[0][0], item[0][1])):
        print(f"{count / steps:6.1f}  {op:40s} {where}")


if __name__ == "__main__":
    sys.exit(main())
