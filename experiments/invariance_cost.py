"""Decode throughput with ``engine.batch_invariant`` on vs off, measured in the same run.

For each batch size, ``B`` seeded requests (temperature 1) are prefilled, then their decode
steps are timed; the two modes alternate, repeat after repeat, so both see the same machine
load, and each mode's best repeat is kept; slowdown is the extra time per token (off / on - 1).
Extra arguments are Hydra overrides of the engine config (e.g. ``backend.device=cuda``).

    python experiments/invariance_cost.py [--batch-sizes 1 8 32] [--steps 16] [--repeats 3] [--tag T]
        [--backend reference] [overrides...]

With ``decoding=dspark decoding.varlen=false`` a step emits several tokens; the rate counts
tokens. Prints a table and writes ``experiments/results/invariance_cost_<device>[_<tag>].csv``.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import platform
import random
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"


def decode_tokens_per_second(llm: LLM, batch: int, steps: int, seed: int) -> float:
    """Prefill ``batch`` short prompts, then time ``steps`` decode steps of all of them."""
    rng = random.Random(seed)
    vocab = llm.model.cfg.vocab_size
    requests = [llm.add_request([rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))],
                                SamplingParams(temperature=1.0, seed=rng.getrandbits(64), max_tokens=steps + 1,
                                               ignore_eos=True))
                for _ in range(batch)]
    while any(not r.output_token_ids for r in requests):
        llm.step()
    _synchronize(llm)
    started = time.perf_counter()
    while not all(r.finished for r in requests):  # ``steps`` steps, or fewer with DSpark drafts
        llm.step()
    _synchronize(llm)
    elapsed = time.perf_counter() - started
    if not all(len(r.output_token_ids) == steps + 1 for r in requests):
        raise RuntimeError("the decode steps did not run every request to its last token")
    return batch * steps / elapsed


def _synchronize(llm: LLM) -> None:
    device = llm.model.embed.weight.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", default="tiny_random")
    parser.add_argument("--backend", default="reference", help="e.g. sm100 (with backend.fallback=reference)")
    parser.add_argument("--tag", default="", help="suffix of the CSV name, e.g. dspark")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. backend.device=cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = ["engine.use_tqdm=false", f"engine.max_num_seqs={max(args.batch_sizes)}", *args.overrides]
    engines = {mode: LLM(args.model, args.backend, base + [f"engine.batch_invariant={mode}"])
               for mode in ("false", "true")}
    device = engines["false"].model.embed.weight.device
    best = {(b, m): 0.0 for b in args.batch_sizes for m in engines}
    for repeat in range(args.repeats):
        for batch in args.batch_sizes:
            for mode, llm in engines.items():
                rate = decode_tokens_per_second(llm, batch, args.steps, seed=repeat)
                best[batch, mode] = max(best[batch, mode], rate)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()} {args.threads} threads")
    stamp = dict(machine=machine, torch=torch.__version__, date=datetime.date.today().isoformat(),
                 command=" ".join(["python", *sys.argv]), model=args.model,
                 backend=args.backend)
    rows = []
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'slowdown':>9}")
    for batch in args.batch_sizes:
        off, on = best[batch, "false"], best[batch, "true"]
        slowdown = 100 * (off / on - 1)
        print(f"{batch:5d} {off:10.1f} {on:10.1f} {slowdown:8.1f}%")
        rows.append(dict(batch=batch, decode_tok_s_off=round(off, 2), decode_tok_s_on=round(on, 2),
                         slowdown_pct=round(slowdown, 1)))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"invariance_cost_{device.type}{'_' + args.tag if args.tag else ''}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*stamp, *rows[0]])
        writer.writeheader()
        writer.writerows({**stamp, **row} for row in rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
