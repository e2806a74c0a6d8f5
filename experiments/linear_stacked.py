"""The decode-time linears of ``model=small`` on one GPU, alone and stacked where they share their
input: cuBLAS (``torch.nn.functional.linear``, one call per weight, what ``linear_kernel=auto``
takes above 16 rows) beside sm100's Triton kernel for few rows
(``fused/linear_skinny.py``, one launch per stack) at each tile choice of a small grid.

Per stack and row count: each one's time (CUDA-graph replay, median of 5 rounds), the weight bytes
it must read over that time as a share of the copy bandwidth measured in the same run; the best
tiles per point and the tiles best over all points (by the sum of their times over cuBLAS's)
are printed. Writes ``experiments/results/linear_stacked_<card>.csv``.

    python experiments/linear_stacked.py [study.rows=[1,4,16]] [study.only=[NAME_PART,...]]
        [study.output_dir=DIR] [overrides...]
"""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ceilings, timed  # noqa: E402

STACKS = {"attn_in (wq_a wkv weights_proj comp.wkv comp.wgate)": ((1280, 512, 64, 512, 512), 4096),
          "q_b (wq_b indexer.wq_b)": ((32768, 8192), 1280), "wo_b": ((4096,), 4096),
          "shared (gate w1 w3)": ((16, 2304, 2304), 4096), "shared.w2": ((4096,), 2304),
          "indexer.wk": ((128,), 512), "lm_head": ((129280,), 4096)}
"""``(widths, K)`` of the decode linears of ``model=small`` (``configs/model/small.yaml``), stacked
where they read the same input."""
GRID = [dict(block_n=n, block_k=k, warps=w, stages=s)
        for n, (k, w, s) in itertools.product((16, 32, 64), ((128, 4, 4), (256, 4, 4), (512, 4, 3), (512, 8, 3)))]


@dataclass
class Settings(StudySettings):
    """Which row counts and stacks run."""

    FAST = ("study.rows=[1]", "study.only=[wo_b,indexer.wk]")
    DEVICE = "cuda"

    rows: list[int] = field(default_factory=lambda: [1, 4, 16])
    """Rows of the input (decode batch sizes)."""
    only: list[str] = field(default_factory=list)
    """Keep the stacks whose name contains one of these (empty: every stack)."""


def measure_stack(name: str, widths: tuple[int, ...], k: int, row_counts: list[int], bandwidth: float, g,
                  ratios: dict) -> list[dict]:
    """cuBLAS and each tile choice of :data:`GRID` that fits ``widths`` on one stack, at each row
    count (each checked against cuBLAS); their times over cuBLAS's go into ``ratios[label][(name, rows)]``."""
    w = torch.randn(sum(widths), k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    parts = list(w.split(list(widths)))
    out = []
    for rows in row_counts:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
        moved = 2 * (w.numel() + rows * (w.shape[0] + k))
        points = time_tiles(x, parts, widths)
        cublas = points[0][1]
        for label, seconds in points[1:]:
            ratios.setdefault(label, {})[(name, rows)] = seconds / cublas
        out += [{"name": name, "widths": " ".join(map(str, widths)), "k": k, "rows": rows, "kernel": label,
                 "time_us": round(seconds * 1e6, 2), "frac_copy_bw": round(moved / seconds / bandwidth, 3),
                 "over_cublas": round(seconds / cublas, 3)} for label, seconds in points]
        best = min(points[1:], key=lambda p: p[1])
        print(f"{name:<52} K={k:<5} rows={rows:<3} cublas {cublas * 1e6:7.1f} us ({moved / cublas / bandwidth:.2f} "
              f"bw)  best {best[0]:<26} {best[1] * 1e6:7.1f} us ({moved / best[1] / bandwidth:.2f} bw)", flush=True)
    return out


def time_tiles(x: torch.Tensor, parts: list[torch.Tensor], widths: tuple[int, ...]) -> list[tuple[str, float]]:
    """``(label, seconds)``: cuBLAS first, then the Triton kernel at each tile choice that fits."""
    from deepinfer_backends.sm100.fused.linear_skinny import linear_skinny

    cublas, _ = timed(lambda: [F.linear(x, p) for p in parts])
    want = [F.linear(x, p) for p in parts]
    points = [("cublas", cublas)]
    for tiles in GRID:
        if any(width % tiles["block_n"] for width in widths):
            continue
        for a, b in zip(linear_skinny(x, parts, tiles), want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        seconds, _ = timed(lambda: linear_skinny(x, parts, tiles))
        points.append(("triton n{block_n} k{block_k} w{warps} s{stages}".format(**tiles), seconds))
    return points


def main(argv=None) -> int:
    _, settings = compose_study("linear_stacked", Settings, argv)
    card = torch.cuda.get_device_name().replace(" ", "_")
    bandwidth = ceilings()["copy_bw"]
    g = torch.Generator("cuda").manual_seed(0)
    stacks = {name: stack for name, stack in STACKS.items()
              if not settings.only or any(part in name for part in settings.only)}
    rows_out, ratios = [], {}
    for name, (widths, k) in stacks.items():
        rows_out += measure_stack(name, widths, k, settings.rows, bandwidth, g, ratios)
    points = len(stacks) * len(settings.rows)
    complete = {label: sum(r.values()) for label, r in ratios.items() if len(r) == points}
    for label, total in sorted(complete.items(), key=lambda kv: kv[1])[:5]:
        print(f"over every point: {label:<26} mean time over cuBLAS {total / points:.3f}")
    print("wrote", write_results(settings.results_path(f"linear_stacked_{card.lower().removeprefix('nvidia_')}"),
                                 rows_out, study_command("linear_stacked", argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
