"""Decode throughput with ``engine.batch_invariant`` on vs off, measured in the same run.

For each batch size, ``B`` seeded requests (temperature 1) are prefilled, then their decode
steps are timed; the two modes alternate, repeat after repeat, so both see the same machine
load, and each mode's best repeat is kept; slowdown is the extra time per token (off / on - 1).
The engine is the composed config (``configs/experiment/invariance_cost.yaml``: ``model=tiny_random``
on the reference backend; e.g. ``backend.device=cuda`` or ``backend=sm100 backend.fallback=reference``).

    python experiments/invariance_cost.py [study.batch_sizes=[1,8,32]] [study.steps=16] [study.repeats=3]
        [study.tag=T] [overrides...]

With ``decoding=dspark decoding.varlen=false`` a step emits several tokens; the rate counts
tokens. Prints a table and writes ``experiments/results/invariance_cost_<device>[_<tag>].csv``.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command


@dataclass
class Settings(StudySettings):
    """The batch sizes and how long each is timed."""

    FAST = ("study.batch_sizes=[1,2]", "study.steps=4", "study.repeats=1", "study.threads=1")

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    """Batch sizes, each timed in both modes."""
    steps: int = 16
    """Decode steps timed per repeat."""
    repeats: int = 3
    """Repeats of every (batch, mode); the best is kept."""
    threads: Optional[int] = None
    """Torch CPU threads; None: torch's default."""


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


def engines(app, max_batch: int) -> dict[str, LLM]:
    """The engine ``app`` describes with ``engine.batch_invariant`` off (``false``) and on (``true``)."""
    return {mode: LLM.from_config(dataclasses.replace(app, engine=dataclasses.replace(
        app.engine, max_num_seqs=max_batch, batch_invariant=mode == "true"))) for mode in ("false", "true")}


def main(argv=None) -> int:
    app, settings = compose_study("invariance_cost", Settings, argv)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    llms = engines(app, max(settings.batch_sizes))
    device = llms["false"].model.embed.weight.device
    best = {(b, m): 0.0 for b in settings.batch_sizes for m in llms}
    for repeat in range(settings.repeats):
        for batch in settings.batch_sizes:
            for mode, llm in llms.items():
                rate = decode_tokens_per_second(llm, batch, settings.steps, seed=repeat)
                best[batch, mode] = max(best[batch, mode], rate)
    rows = []
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'slowdown':>9}")
    for batch in settings.batch_sizes:
        off, on = best[batch, "false"], best[batch, "true"]
        slowdown = 100 * (off / on - 1)
        print(f"{batch:5d} {off:10.1f} {on:10.1f} {slowdown:8.1f}%")
        rows.append(dict(model=app.model.name, backend=app.backend.name, threads=torch.get_num_threads(), batch=batch,
                         decode_tok_s_off=round(off, 2), decode_tok_s_on=round(on, 2), slowdown_pct=round(slowdown, 1)))
    path = write_results(settings.results_path(f"invariance_cost_{device.type}"), rows,
                         study_command("invariance_cost", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
