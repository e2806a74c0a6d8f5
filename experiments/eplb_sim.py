"""EPLB's policy on synthetic skewed routing (``deepinfer/parallel/eplb.py``): the largest rank load
over the mean, before (the static placement: experts in order, redundant slots replicating experts
``0, 1, ..``) and after rebalancing, against the number of redundant experts, for 256 and 384
routed experts at EP 8 to 64. Each step routes 4,096 tokens x top-k 8 by a Zipf law over a random
order of the experts (``study.exponent``), Poisson noise per step; the policy sees ``study.steps``
steps and is judged on the next ``study.steps`` (same law, fresh noise). Prints the table, writes
``experiments/results/eplb_sim.csv`` and a plot beside it.

    python experiments/eplb_sim.py [study.steps=20] [study.exponent=1.0] [study.seed=0]"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.parallel.eplb import rebalance, static_placement
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command


@dataclass
class Settings(StudySettings):
    """The routing the policy sees and is judged on."""

    FAST = ("study.steps=4",)
    PLOTS = True

    steps: int = 20
    """Steps of routing the policy sees, and steps it is judged on."""
    exponent: float = 1.0
    """Zipf exponent of the experts' popularity."""
    seed: int = 0
    """Seed of the experts' order and the routing noise."""


def routed_loads(steps: int, experts: int, exponent: float, gen: torch.Generator, order: torch.Tensor) -> torch.Tensor:
    """``[steps, experts]`` routed tokens: 4,096 tokens x 8 experts a step over a Zipf law."""
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    rate = (4096 * 8 * weights / weights.sum())[order]
    return torch.poisson(rate.expand(steps, experts).contiguous(), generator=gen)


def balance_rows(experts: int, ranks: int, settings: Settings) -> list[dict]:
    """Static and rebalanced imbalance of ``experts`` over ``ranks``, by redundant experts per rank."""
    gen = torch.Generator().manual_seed(settings.seed + experts + ranks)
    order = torch.randperm(experts, generator=gen)
    seen = routed_loads(settings.steps, experts, settings.exponent, gen, order)
    judged = routed_loads(settings.steps, experts, settings.exponent, gen, order)
    rows = []
    for per_rank in (0, 1, 2, 4):
        extra = per_rank * ranks
        before = static_placement(experts, extra, ranks).imbalance(judged)
        after = rebalance(seen, extra, ranks).imbalance(judged)
        rows.append({"experts": experts, "ep": ranks, "redundant": extra, "static": round(before, 4),
                     "rebalanced": round(after, 4)})
        print(f"E={experts:4d} EP={ranks:3d} redundant={extra:4d}: max/mean rank load "
              f"{before:6.3f} static, {after:6.3f} rebalanced")
    return rows


def main(argv=None) -> int:
    app, settings = compose_study("eplb_sim", Settings, argv)
    rows = [row for experts in (256, 384) for ranks in (8, 16, 32, 64)
            for row in balance_rows(experts, ranks, settings)]
    path = write_results(settings.results_path("eplb_sim"), [{"exponent": settings.exponent, **r} for r in rows],
                         study_command("eplb_sim", argv))
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
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
