"""DSpark acceptance and speedup.

Reports acceptance per draft position, mean accepted length, tokens per target forward (DSpark on
vs off) and wall-clock speedup at several batch sizes. Writes a CSV and a PNG under
experiments/results/.

    python experiments/dspark_acceptance.py [--batches 1,8,32] [--max-tokens 48] [hydra overrides...]

for example ``model=tiny backend=reference`` (the defaults) or ``model.checkpoint=DIR``.
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config.compose import compose

RESULTS = Path(__file__).resolve().parent / "results"


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def heldout_prompts(llm: LLM, count: int) -> list[str]:
    """The held-out prompts shipped with the checkpoint (``heldout_sample.json``), cycled."""
    from deepinfer.models.registry import resolve_checkpoint

    sample = json.loads((Path(resolve_checkpoint(llm.config.model.checkpoint)) / "heldout_sample.json").read_text())
    return [sample["prompts"][i % len(sample["prompts"])] for i in range(count)]


def run(overrides: list[str], batch: int, max_tokens: int, temperature: float, draft: bool, heldout: bool):
    extra = ["decoding=dspark"] if draft else ["decoding=greedy"]
    app = compose(overrides + extra + [f"engine.max_num_seqs={max(batch, 1)}", "engine.use_tqdm=false"])
    llm = LLM.from_config(app)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1)
    batch_prompts = heldout_prompts(llm, batch) if heldout else prompts(batch, llm.model.cfg.vocab_size)
    llm.generate(batch_prompts[:1], SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True))
    started = time.perf_counter()
    outputs = llm.generate(batch_prompts, params)
    return outputs, time.perf_counter() - started, app.decoding.num_draft_tokens if draft else 0


def per_position(outputs, k: int) -> list[float]:
    verified, accepted = [0] * k, [0] * k
    for out in outputs:
        for drafted, taken in out.verify_log:
            for i in range(drafted):
                verified[i] += 1
                accepted[i] += i < taken
    return [a / v if v else 0.0 for a, v in zip(accepted, verified)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--heldout", action="store_true",
                        help="prompts from the checkpoint's heldout_sample.json instead of random token ids")
    args, overrides = parser.parse_known_args()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        plain, plain_s, _ = run(overrides, batch, args.max_tokens, args.temperature, False, args.heldout)
        drafted, draft_s, k = run(overrides, batch, args.max_tokens, args.temperature, True, args.heldout)
        tokens = sum(len(o.token_ids) for o in drafted)
        forwards = sum(len(o.token_ids) - o.num_accepted for o in drafted)
        steps = sum(o.metrics["verify_steps"] for o in drafted)
        rates = per_position(drafted, k)
        rows.append({
            "batch": batch, "draft_tokens": k, "mean_accepted_length": sum(o.num_accepted for o in drafted) / max(steps, 1),
            "tokens_per_target_forward": tokens / max(forwards, 1),
            "wall_speedup": plain_s / draft_s, "plain_s": plain_s, "dspark_s": draft_s,
            "calibration_error": sum(o.metrics["calibration_error"] for o in drafted) / len(drafted),
            **{f"accept_pos{i}": r for i, r in enumerate(rates)},
        })
        print(" | ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                         for key, value in rows[-1].items()), flush=True)
    write(rows, args, overrides)


def write(rows, args, overrides) -> None:
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path = RESULTS / f"dspark_acceptance_{args.tag}.csv"
    with path.open("w", newline="") as f:
        card = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
        f.write(f"# {stamp}; {platform.node()} {platform.processor() or platform.machine()}{card}, torch {torch.__version__}; "
                f"command: python experiments/dspark_acceptance.py {' '.join(sys.argv[1:])}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'deepinfer[experiments]'): no plot")
        return
    k = rows[0]["draft_tokens"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ax.plot(range(1, k + 1), [row[f"accept_pos{i}"] for i in range(k)], marker="o", label=f"batch {row['batch']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given verified)")
    ax.set_ylim(0, 1)
    ax.set_title(f"DSpark acceptance ({' '.join(overrides) or 'model=tiny'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
