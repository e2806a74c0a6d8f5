"""EPLB's policy on synthetic skewed routing (``deepinfer/parallel/eplb.py``): the largest rank load
over the mean, before (the static placement: experts in order, redundant slots replicating experts
``0, 1, ..``) and after rebalancing, against the number of redundant experts, for 256 and 384
routed experts at EP 8 to 64. Each step routes 4,096 tokens x top-k 8 by a Zipf law over a random
order of the experts (``--exponent``), Poisson noise per step; the policy sees ``--steps`` steps and
is judged on the next ``--steps`` (same law, fresh noise). Prints the table, writes
``experiments/results/eplb_sim.csv`` and a plot beside it.

    python experiments/eplb_sim.py [--steps 20] [--exponent 1.0]"""
from __future__ import annotations

import argparse
import csv
import datetime
import platform
import sys
from pathlib import Path

import torch

from deepinfer.parallel.eplb import rebalance, static_placement
from deepinfer.results import pyplot

RESULTS = Path(__file__).resolve().parent / "results"


def routed_loads(steps: int, experts: int, exponent: float, gen: torch.Generator, order: torch.Tensor) -> torch.Tensor:
    """``[steps, experts]`` routed tokens: 4,096 tokens x 8 experts a step over a Zipf law."""
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    rate = (4096 * 8 * weights / weights.sum())[order]
    return torch.poisson(rate.expand(steps, experts).contiguous(), generator=gen)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--exponent", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = []
    for experts in (256, 384):
        for ranks in (8, 16, 32, 64):
            gen = torch.Generator().manual_seed(args.seed + experts + ranks)
            order = torch.randperm(experts, generator=gen)
            seen = routed_loads(args.steps, experts, args.exponent, gen, order)
            judged = routed_loads(args.steps, experts, args.exponent, gen, order)
            for per_rank in (0, 1, 2, 4):
                extra = per_rank * ranks
                before = static_placement(experts, extra, ranks).imbalance(judged)
                after = rebalance(seen, extra, ranks).imbalance(judged)
                rows.append({"experts": experts, "ep": ranks, "redundant": extra, "static": round(before, 4),
                             "rebalanced": round(after, 4)})
                print(f"E={experts:4d} EP={ranks:3d} redundant={extra:4d}: max/mean rank load "
                      f"{before:6.3f} static, {after:6.3f} rebalanced")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "eplb_sim.csv"
    command = "python experiments/eplb_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["machine", "torch", "date", "command", "exponent", *rows[0]])
        writer.writeheader()
        for row in rows:
            writer.writerow({"machine": platform.machine(), "torch": torch.__version__,
                             "date": datetime.date.today().isoformat(), "command": command,
                             "exponent": args.exponent, **row})
    _plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, experts in zip(axes, (256, 384)):
        for ep in sorted({r["ep"] for r in rows}):
            points = [r for r in rows if r["experts"] == experts and r["ep"] == ep]
            ax.plot([r["redundant"] // ep for r in points], [r["rebalanced"] for r in points], marker="o",
                    label=f"EP {ep}")
            ax.plot([r["redundant"] // ep for r in points], [r["static"] for r in points], linestyle=":",
                    color=ax.lines[-1].get_color())
        ax.set_title(f"{experts} routed experts (dotted: static placement)")
        ax.set_xlabel("redundant experts per rank")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("largest rank load / mean")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
