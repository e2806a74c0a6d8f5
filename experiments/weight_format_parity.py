"""Backend parity of a model with quantized weights (``model.weight_format``), on one GPU.

For each weight format the model is built once (seeded random weights, held as the format says)
and run by two backends over the same tokens: a prefill of ``--batch`` prompts, then ``--steps``
decode steps fed the first backend's greedy tokens, so both see the same inputs at every step.
Per step it reports the relative L2 error of the second backend's logits against the first's,
the largest absolute error and the share of rows whose argmax agrees, and writes
``experiments/results/weight_format_parity_<tag>.csv``. The second backend runs without a
fallback, so an op it lacks fails the run.

    python experiments/weight_format_parity.py --model small --formats none fp8 mxfp4
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import hold_quantized, init_random_weights
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.registry import build_config, model_preset

RESULTS = Path(__file__).resolve().parent / "results"


class SwitchedOps:
    """An op table whose backend can be swapped after the model holds it."""

    def __init__(self, tables: dict[str, OpTable]):
        self.tables, self.current = tables, next(iter(tables))

    def __getattr__(self, name):
        return getattr(self.tables[self.current], name)


def run_backend(model, ops: SwitchedOps, backend: str, prompts: list[list[int]], steps: int,
                feed: list[list[int]] | None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits of the prefill and each decode step on ``backend``; decode feeds ``feed`` (default
    this backend's own greedy tokens)."""
    ops.current = backend
    device = model.embed.weight.device
    length = len(prompts[0]) + steps + 1
    blocks = math.ceil(length / PAGE_TOKENS)
    caches = model.allocate_caches(1 + len(prompts) * blocks, len(prompts) + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(prompts))]
    slots = list(range(1, len(prompts) + 1))
    logits, tokens = [], []
    with torch.no_grad():
        ctx = ForwardContext.for_sequences(prompts, [0] * len(prompts), slots, tables, device=device)
        logits.append(model(ctx, caches).float())
        for step in range(steps):
            chosen = feed[step] if feed else logits[-1].argmax(-1).tolist()
            tokens.append(chosen)
            starts = [len(prompts[0]) + step] * len(prompts)
            ctx = ForwardContext.for_sequences([[t] for t in chosen], starts, slots, tables, decode=True,
                                               device=device)
            logits.append(model(ctx, caches).float())
    return logits, tokens


def compare(want: torch.Tensor, got: torch.Tensor) -> dict:
    """Relative L2 error, largest absolute error and argmax agreement of ``got`` against ``want``."""
    return {"rel_l2": ((got - want).norm() / want.norm()).item(), "max_abs": (got - want).abs().max().item(),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--formats", nargs="+", default=["none", "fp8", "mxfp4"])
    parser.add_argument("--backends", nargs=2, default=["reference", "sm100"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--commit", default="")
    args = parser.parse_args(argv)
    preset = model_preset(args.model)
    config = build_config(preset)
    dtype = getattr(torch, preset["dtype"])
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config.vocab_size - 1, (args.batch, args.prompt_len), generator=gen).tolist()
    ops = SwitchedOps({name: OpTable(name) for name in args.backends})
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    stamp = {"card": card, "date": datetime.date.today().isoformat(), "commit": commit,
             "command": " ".join(["python", *sys.argv])}
    rows = []
    for fmt in args.formats:
        started = time.time()
        model = DeepseekV41ForCausalLM(config, ops, dtype=dtype, max_model_len=args.prompt_len + args.steps + 64)
        model = hold_quantized(init_random_weights(model, 0), None if fmt == "none" else fmt).to(args.device)
        built = time.time() - started
        want, fed = run_backend(model, ops, args.backends[0], prompts, args.steps, None)
        got, _ = run_backend(model, ops, args.backends[1], prompts, args.steps, fed)
        for step, (w, g) in enumerate(zip(want, got)):
            row = {**stamp, "model": args.model, "weight_format": fmt, "step": "prefill" if step == 0 else step,
                   **{k: round(v, 6) for k, v in compare(w, g).items()}}
            rows.append(row)
            print(f"{fmt:>6} {row['step']!s:>8} rel_l2 {row['rel_l2']:.2e} max_abs {row['max_abs']:.3e} "
                  f"argmax agree {row['argmax_agree']:.3f}", flush=True)
        print(f"{fmt}: model built in {built:.0f} s", flush=True)
        del model
        torch.cuda.empty_cache()
    path = RESULTS / f"weight_format_parity_{args.tag}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
