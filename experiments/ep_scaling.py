"""Expert parallelism beyond one machine, on paper: for V4.1-Flash's sizes (hidden 4096, 40 MoE
layers, 384 routed experts, top-6) at EP 8 to 64, what one decode step moves per rank in the MoE
dispatch and combine, how long that takes over NVLink within a node of 8 GPUs and RDMA between
nodes, and how evenly the experts' work spreads with and without EPLB (``deepinfer/parallel/eplb.py``
on Zipf-skewed routing). A model, not a measurement: the inputs are printed with the table.

- Dispatch sends each token's row once to every other rank that holds one of its experts (DeepEP's
  dedup), as FP8 with a UE8M0 scale per 32 values: 4096 + 128 bytes. Combine sends one bf16 row
  back per (token, rank): 8192 bytes.
- Routing is uniform for the byte counts (a token's 6 experts fall on ``EP (1 - (1 - 1/EP)^6)``
  ranks on average); ranks beyond the first node's 8 are reached over RDMA.
- Balance: ``max / mean`` of the ranks' routed tokens for Zipf(``study.exponent``) loads over a random
  order of the experts, static placement against EPLB with one redundant expert per rank.

Prints the table, writes ``experiments/results/ep_scaling.csv`` and a plot beside it.

    python experiments/ep_scaling.py [study.tokens_per_rank=128] [study.nvlink_gbs=450] [study.rdma_gbs=50]
        [study.exponent=1.0] [study.steps=20]"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.parallel.eplb import rebalance, static_placement
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command

HIDDEN, LAYERS, EXPERTS, TOP_K, NODE = 4096, 40, 384, 6, 8
DISPATCH_ROW = HIDDEN + HIDDEN // 32  # FP8 values and their UE8M0 scales
COMBINE_ROW = 2 * HIDDEN  # bf16


@dataclass
class Settings(StudySettings):
    """The decode load and the links of the model."""

    FAST = ("study.steps=4",)
    PLOTS = True

    tokens_per_rank: int = 128
    """Decode rows a rank routes a step."""
    nvlink_gbs: float = 450.0
    """GB/s a GPU sends within its node."""
    rdma_gbs: float = 50.0
    """GB/s a GPU sends to other nodes."""
    exponent: float = 1.0
    """Zipf exponent of the experts' popularity."""
    steps: int = 20
    """Steps of routing EPLB's policy sees, and steps it is judged on."""


def ranks_reached(ep: int) -> float:
    """Expected distinct ranks holding one of a token's ``TOP_K`` experts (uniform routing)."""
    return ep * (1 - (1 - 1 / ep) ** TOP_K)


def zipf_loads(steps: int, tokens: int, exponent: float, order: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``[steps, EXPERTS]`` routed slots of ``tokens`` tokens a step, the experts' popularity by a
    Zipf law in ``order``, Poisson noise per step."""
    weights = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** exponent
    rate = (tokens * TOP_K * weights / weights.sum())[order]
    return torch.poisson(rate.expand(steps, EXPERTS).contiguous(), generator=gen)


def ep_row(ep: int, settings: Settings) -> dict:
    """The exchange and the balance at expert parallelism ``ep``."""
    reached = ranks_reached(ep)
    remote = reached * (1 - 1 / ep)  # the token's own rank sends nothing
    off_node = remote * max(0, ep - NODE) / (ep - 1)
    on_node = remote - off_node
    per_layer = settings.tokens_per_rank * (DISPATCH_ROW + COMBINE_ROW)
    seconds = LAYERS * per_layer * (on_node / (settings.nvlink_gbs * 1e9) + off_node / (settings.rdma_gbs * 1e9))
    gen = torch.Generator().manual_seed(ep)
    order = torch.randperm(EXPERTS, generator=gen)
    seen = zipf_loads(settings.steps, settings.tokens_per_rank * ep, settings.exponent, order, gen)
    judged = zipf_loads(settings.steps, settings.tokens_per_rank * ep, settings.exponent, order, gen)
    return {"ep": ep, "tokens_per_rank": settings.tokens_per_rank, "ranks_reached": round(reached, 2),
            "mb_per_rank_step": round(LAYERS * per_layer * remote / 1e6, 1),
            "mb_off_node_per_rank_step": round(LAYERS * per_layer * off_node / 1e6, 1),
            "exchange_ms": round(1e3 * seconds, 3),
            "imbalance_static": round(static_placement(EXPERTS, 0, ep).imbalance(judged), 3),
            "imbalance_eplb": round(rebalance(seen, ep, ep).imbalance(judged), 3)}


def main(argv=None) -> int:
    app, settings = compose_study("ep_scaling", Settings, argv)
    rows = [ep_row(ep, settings) for ep in (8, 16, 32, 64)]
    print(f"V4.1-Flash MoE (H={HIDDEN}, {LAYERS} layers, E={EXPERTS}, top-{TOP_K}), {settings.tokens_per_rank} decode "
          f"rows a rank, NVLink {settings.nvlink_gbs:g} GB/s, RDMA {settings.rdma_gbs:g} GB/s, Zipf exponent "
          f"{settings.exponent:g}")
    print(f"{'EP':>4} {'ranks/token':>11} {'MB/rank/step':>12} {'of it RDMA':>10} {'exchange ms':>11} "
          f"{'max/mean static':>15} {'EPLB (+1/rank)':>14}")
    for r in rows:
        print(f"{r['ep']:4d} {r['ranks_reached']:11.2f} {r['mb_per_rank_step']:12.1f} "
              f"{r['mb_off_node_per_rank_step']:10.1f} {r['exchange_ms']:11.3f} {r['imbalance_static']:15.3f} "
              f"{r['imbalance_eplb']:14.3f}")
    inputs = {"nvlink_gbs": settings.nvlink_gbs, "rdma_gbs": settings.rdma_gbs, "exponent": settings.exponent}
    path = write_results(settings.results_path("ep_scaling"), [{**inputs, **r} for r in rows],
                         study_command("ep_scaling", argv))
    _plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    eps = [r["ep"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(eps, [r["exchange_ms"] for r in rows], marker="o")
    left.set(xscale="log", xticks=eps, xticklabels=eps, xlabel="EP ranks", ylabel="dispatch + combine ms a step",
             title="MoE exchange per decode step (model)")
    right.plot(eps, [r["imbalance_static"] for r in rows], marker="o", label="static")
    right.plot(eps, [r["imbalance_eplb"] for r in rows], marker="o", label="EPLB, +1 expert a rank")
    right.set(xscale="log", xticks=eps, xticklabels=eps, xlabel="EP ranks", ylabel="largest rank load / mean",
              title="expert work balance")
    right.legend()
    for ax in (left, right):
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
