"""Soak: many requests of random lengths and kinds through one engine on a KV budget that forces
preemption, and the books kept: every request finishes exactly once, with the length it asked
for (or a stop it reached), none failed, none lost.

    python experiments/soak.py [study.requests=1000] [study.max_prompt=4096] [study.max_output=64]
        [study.kv_blocks=N] [study.check_alone=20] [study.structured=false] [study.tag=T] [overrides...]

Requests mix greedy, seeded sampling and structured outputs (a regex, a JSON schema); DSpark
drafts them all (``configs/experiment/soak.yaml`` picks ``decoding=dspark``). ``study.kv_blocks``
defaults to what two of the longest requests need, so that long prompts preempt each other. With
``engine.batch_invariant=true``, ``study.check_alone=N`` runs N random requests again alone (on a
fresh engine) and requires the same tokens. Prints a progress line every ``study.progress_s``
seconds, then the counts, and writes ``experiments/results/soak_<device>[_<tag>].csv``."""
from __future__ import annotations

import collections
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

from deepinfer import LLM, SamplingParams
from deepinfer.engine.output_processor import request_output
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

KINDS = ("greedy", "sampled", "regex", "json")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@dataclass
class Settings(StudySettings):
    """The soak's requests and budget."""

    FAST = ("model=tiny_random", "engine.prefill_chunk_tokens=64", "study.requests=100", "study.max_prompt=250",
            "study.max_output=8", "study.kv_blocks=4", "study.check_alone=4")

    requests: int = 1000
    """Requests submitted at once."""
    max_prompt: int = 4096
    """Prompt lengths are uniform in 1..max_prompt (random token ids)."""
    max_output: int = 64
    """Output lengths are uniform in 1..max_output."""
    kv_blocks: Optional[int] = None
    """Paged KV blocks of 128 tokens; None: what two of the longest requests need."""
    check_alone: int = 0
    """Requests run again alone on a fresh engine, whose tokens must be the same (batch invariance)."""
    structured: bool = True
    """Mix in regex and JSON-schema requests (needs xgrammar)."""
    seed: int = 0
    """Seed of the request mix."""
    progress_s: float = 60.0
    """Seconds between progress lines (finished, running, waiting, preemptions)."""


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


def run_with_progress(llm: LLM, made, every_s: float) -> list:
    """Queue every request and step the engine until all finish, printing a progress line every
    ``every_s`` seconds; the outputs in submission order."""
    requests = [llm.add_request(prompt, params) for _, prompt, params in made]
    started = last = time.perf_counter()
    while not all(r.finished for r in requests):
        llm.step()
        if time.perf_counter() - last >= every_s:
            last = time.perf_counter()
            done = sum(r.finished for r in requests)
            print(f"[{last - started:7.0f} s] finished {done}/{len(requests)}, running {len(llm.scheduler.running)}, "
                  f"waiting {len(llm.scheduler.waiting)}, preemptions {llm.scheduler.num_preemptions}", flush=True)
    llm.drain()
    return [request_output(r) for r in requests]


def soak(app, settings: Settings) -> dict:
    """Run the soak on the engine ``app`` describes; returns its counts (``submitted``,
    ``completed``, ``preempted``, outcomes by kind, ``alone_checked`` and ``alone_equal``,
    ``seconds``)."""
    page = 128
    blocks = settings.kv_blocks or 2 * math.ceil((settings.max_prompt + settings.max_output) / page) + 1
    app = dataclasses.replace(
        app, model=dataclasses.replace(app.model, max_model_len=settings.max_prompt + settings.max_output + 16),
        engine=dataclasses.replace(app.engine, num_kv_blocks=blocks, use_tqdm=False))
    llm = LLM.from_config(app)
    made = make_requests(settings.requests, settings.max_prompt, settings.max_output, llm.model.cfg.vocab_size,
                         settings.seed, settings.structured)
    started = time.perf_counter()
    outputs = run_with_progress(llm, made, settings.progress_s)
    seconds = time.perf_counter() - started
    counts = check_outputs(made, outputs)
    result = {"submitted": settings.requests, "completed": len(outputs), "preempted": llm.scheduler.num_preemptions,
              "kv_blocks": blocks, "seconds": round(seconds, 1), **dict(sorted(counts.items()))}
    if settings.check_alone:
        picked = random.Random(settings.seed + 1).sample(range(settings.requests),
                                                         min(settings.check_alone, settings.requests))
        alone = LLM.from_config(app)
        equal = sum(alone.generate([made[i][1]], [made[i][2]])[0].token_ids == outputs[i].token_ids for i in picked)
        result.update(alone_checked=len(picked), alone_equal=equal)
    return result


def main(argv=None) -> int:
    app, settings = compose_study("soak", Settings, argv)
    result = soak(app, settings)
    for key, value in result.items():
        print(f"{key:24} {value}")
    path = write_results(settings.results_path(f"soak_{app.backend.device}"),
                         [{"key": key, "value": value} for key, value in result.items()], study_command("soak", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
