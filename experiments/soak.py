"""Soak: many requests of random lengths and kinds through one engine on a KV budget that forces
preemption, and the books kept: every request finishes exactly once, with the length it asked
for (or a stop it reached), none failed, none lost.

    python experiments/soak.py [--model tiny] [--backend reference] [--requests 1000] [--max-prompt 4096]
        [--max-output 64] [--kv-blocks N] [--check-alone 20] [--no-structured] [--tag T] [hydra overrides...]

Requests mix greedy, seeded sampling and structured outputs (a regex, a JSON schema); DSpark
drafts them all with ``decoding=dspark`` (the default here). ``--kv-blocks`` defaults to what two
of the longest requests need, so that long prompts preempt each other. With
``engine.batch_invariant=true``, ``--check-alone N`` runs N random requests again alone (on a
fresh engine) and requires the same tokens. Prints the counts and writes
``experiments/results/soak_<device>[_<tag>].csv``."""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"
KINDS = ("greedy", "sampled", "regex", "json")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def make_requests(count: int, max_prompt: int, max_output: int, vocab: int, seed: int, structured: bool):
    """``count`` (kind, prompt ids, SamplingParams): prompt lengths uniform in 1..max_prompt."""
    rng = random.Random(seed)
    kinds = KINDS if structured else KINDS[:2]
    made = []
    for _ in range(count):
        kind = rng.choice(kinds)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
        length = rng.randint(1, max_output)
        params = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_p=0.9, seed=rng.getrandbits(64)),
                  "regex": dict(temperature=0.0, structured={"type": "regex", "schema": "[a-z]{1,6}"}),
                  "json": dict(temperature=0.0, structured={"type": "json", "schema": SCHEMA})}[kind]
        made.append((kind, prompt, SamplingParams(max_tokens=length, ignore_eos=kind in ("greedy", "sampled"),
                                                  **params)))
    return made


def check_outputs(made, outputs) -> collections.Counter:
    """Counts by outcome; raises if a request is missing, duplicated or ended short without a reason."""
    if len(outputs) != len(made) or len({o.request_id for o in outputs}) != len(made):
        raise RuntimeError(f"{len(made)} requests submitted, {len(outputs)} outputs with "
                           f"{len({o.request_id for o in outputs})} distinct ids")
    counts = collections.Counter()
    for (kind, _, params), out in zip(made, outputs):
        counts[f"{kind}:{out.finish_reason}"] += 1
        if out.finish_reason == "length" and len(out.token_ids) != params.max_tokens:
            raise RuntimeError(f"request {out.request_id} ended 'length' with {len(out.token_ids)} of "
                               f"{params.max_tokens} tokens")
        if out.finish_reason == "error" and kind in ("greedy", "sampled"):
            raise RuntimeError(f"request {out.request_id} ({kind}) failed: {out.error}")
        if out.finish_reason not in ("length", "stop", "error"):
            raise RuntimeError(f"request {out.request_id} ended {out.finish_reason!r}")
    return counts


def soak(model: str, backend: str, overrides: list[str], requests: int, max_prompt: int, max_output: int,
         kv_blocks: int | None, check_alone: int, seed: int = 0, structured: bool = True) -> dict:
    """Run the soak; returns its counts (``submitted``, ``completed``, ``preempted``, outcomes by
    kind, ``alone_checked`` and ``alone_equal``, ``seconds``)."""
    page = 128
    blocks = kv_blocks or 2 * math.ceil((max_prompt + max_output) / page) + 1
    base = ["engine.use_tqdm=false", f"model.max_model_len={max_prompt + max_output + 16}",
            f"engine.num_kv_blocks={blocks}"]
    llm = LLM(model, backend, base + overrides)
    made = make_requests(requests, max_prompt, max_output, llm.model.cfg.vocab_size, seed, structured)
    started = time.perf_counter()
    outputs = llm.generate([p for _, p, _ in made], [params for _, _, params in made])
    seconds = time.perf_counter() - started
    counts = check_outputs(made, outputs)
    result = {"submitted": requests, "completed": len(outputs), "preempted": llm.scheduler.num_preemptions,
              "kv_blocks": blocks, "seconds": round(seconds, 1), **dict(sorted(counts.items()))}
    if check_alone:
        picked = random.Random(seed + 1).sample(range(requests), min(check_alone, requests))
        alone = LLM(model, backend, base + overrides)
        equal = sum(alone.generate([made[i][1]], [made[i][2]])[0].token_ids == outputs[i].token_ids for i in picked)
        result.update(alone_checked=len(picked), alone_equal=equal)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-prompt", type=int, default=4096)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int)
    parser.add_argument("--check-alone", type=int, default=0)
    parser.add_argument("--no-structured", action="store_true", help="greedy and sampled requests only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag")
    args, overrides = parser.parse_known_args(argv)
    if not any(o.startswith("decoding") for o in overrides):
        overrides.append("decoding=dspark")
    result = soak(args.model, args.backend, overrides, args.requests, args.max_prompt, args.max_output,
                  args.kv_blocks, args.check_alone, args.seed, not args.no_structured)
    for key, value in result.items():
        print(f"{key:24} {value}")
    device = "cuda" if any("device=cuda" in o for o in overrides) else "cpu"
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"soak_{device}{'_' + args.tag if args.tag else ''}.csv"
    command = "python experiments/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["machine", "torch", "date", "command", "key", "value"])
        for key, value in result.items():
            writer.writerow([platform.machine(), torch.__version__, datetime.date.today().isoformat(), command,
                             key, value])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
