"""DSpark acceptance and speedup.

Reports acceptance per draft position, mean accepted length, tokens per target forward (DSpark on
vs off) and wall-clock speedup at several batch sizes. Writes a CSV and a PNG under
experiments/results/.

    python experiments/dspark_acceptance.py [study.batches=[1,8,32]] [study.max_tokens=48] [study.heldout=true]
        [study.tag=cpu] [overrides...]

for example ``model=tiny backend=reference`` (the defaults) or ``model.checkpoint=DIR``. DSpark runs
with the composed ``decoding`` (``decoding=dspark`` and its ``decoding.*`` values), the plain run
with the same config and no drafts.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import ConfigError
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command


@dataclass
class Settings(StudySettings):
    """The batch sizes and requests measured."""

    FAST = ("study.batches=[1,2]", "study.max_tokens=8")
    PLOTS = True

    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    """Batch sizes, each run without and with DSpark."""
    max_tokens: int = 48
    """Output tokens per request."""
    temperature: float = 0.0
    """Sampling temperature of every request (seeded)."""
    heldout: bool = False
    """Prompts from the checkpoint's heldout_sample.json instead of random token ids."""
    tag: Optional[str] = "cpu"
    """Suffix of the result files' names (for example the card: ``h200``)."""


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 16..64 random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def heldout_prompts(llm: LLM, count: int) -> list[str]:
    """The held-out prompts shipped with the checkpoint (``heldout_sample.json``), cycled."""
    from deepinfer.models.registry import resolve_checkpoint

    sample = json.loads((Path(resolve_checkpoint(llm.config.model.checkpoint)) / "heldout_sample.json").read_text())
    return [sample["prompts"][i % len(sample["prompts"])] for i in range(count)]


def run(app, settings: Settings, batch: int, draft: bool):
    """(outputs, seconds, draft tokens) of one batch through a fresh engine, with DSpark or without."""
    decoding = app.decoding if draft else dataclasses.replace(app.decoding, name="greedy", num_draft_tokens=0,
                                                              confidence_temperatures=None)
    engine = dataclasses.replace(app.engine, max_num_seqs=max(batch, 1))
    llm = LLM.from_config(dataclasses.replace(app, decoding=decoding, engine=engine))
    params = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_tokens, ignore_eos=True, seed=1)
    batch_prompts = heldout_prompts(llm, batch) if settings.heldout else prompts(batch, llm.model.cfg.vocab_size)
    llm.generate(batch_prompts[:1], SamplingParams(temperature=settings.temperature, max_tokens=4, ignore_eos=True))
    started = time.perf_counter()
    outputs = llm.generate(batch_prompts, params)
    return outputs, time.perf_counter() - started, decoding.num_draft_tokens


def per_position(outputs, k: int) -> list[float]:
    """Acceptance rate of each draft position, among the drafts verified there."""
    verified, accepted = [0] * k, [0] * k
    for out in outputs:
        for drafted, taken in out.verify_log:
            for i in range(drafted):
                verified[i] += 1
                accepted[i] += i < taken
    return [a / v if v else 0.0 for a, v in zip(accepted, verified)]


def measure(app, settings: Settings, batch: int) -> dict:
    """The result row of one batch size."""
    _, plain_s, _ = run(app, settings, batch, False)
    drafted, draft_s, k = run(app, settings, batch, True)
    tokens = sum(len(o.token_ids) for o in drafted)
    forwards = sum(len(o.token_ids) - o.num_accepted for o in drafted)
    steps = sum(o.metrics["verify_steps"] for o in drafted)
    rates = per_position(drafted, k)
    return {
        "batch": batch, "draft_tokens": k, "mean_accepted_length": sum(o.num_accepted for o in drafted) / max(steps, 1),
        "tokens_per_target_forward": tokens / max(forwards, 1),
        "wall_speedup": plain_s / draft_s, "plain_s": plain_s, "dspark_s": draft_s,
        "calibration_error": sum(o.metrics["calibration_error"] for o in drafted) / len(drafted),
        **{f"accept_pos{i}": r for i, r in enumerate(rates)},
    }


def main(argv=None) -> int:
    app, settings = compose_study("dspark_acceptance", Settings, argv)
    if not app.decoding.num_draft_tokens:
        raise ConfigError(f"decoding={app.decoding.name} drafts no tokens: use decoding=dspark (the study's default)")
    rows = []
    for batch in settings.batches:
        rows.append(measure(app, settings, batch))
        print(" | ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                         for key, value in rows[-1].items()), flush=True)
    path = write_results(settings.results_path("dspark_acceptance"), rows, study_command("dspark_acceptance", argv))
    print(f"wrote {path}")
    plot(rows, path, f"model={app.model.name}, backend={app.backend.name} on {app.backend.device}")
    return 0


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Acceptance by draft position, one line per batch size, beside ``path``."""
    plt = pyplot()
    if plt is None:
        return
    k = rows[0]["draft_tokens"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ax.plot(range(1, k + 1), [row[f"accept_pos{i}"] for i in range(k)], marker="o", label=f"batch {row['batch']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given verified)")
    ax.set_ylim(0, 1)
    ax.set_title(f"DSpark acceptance ({title})")
    ax.legend()
    fig.tight_layout()
    print(f"wrote {save_figure(fig, path.with_suffix('.png'))}")


if __name__ == "__main__":
    sys.exit(main())
