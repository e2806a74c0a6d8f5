"""The decode-time linears of ``model=small`` on one GPU, alone and stacked where they share their
input: cuBLAS (``torch.nn.functional.linear``, one call per weight, what ``linear_kernel=auto``
takes below ``SKINNY_ROWS`` rows) beside sm100's Triton kernel for few rows
(``fused/linear_skinny.py``, one launch per stack) at each tile choice of a small grid.

Per stack and row count: each one's time (CUDA-graph replay, median of 5 rounds), the weight bytes
it must read over that time as a share of the copy bandwidth measured in the same run; the best
tiles per point and the tiles best over all points (by the sum of their times over cuBLAS's)
are printed. Writes ``experiments/results/linear_stacked_<card>.csv``.

    python experiments/linear_stacked.py [--rows 1 4 16] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import RESULTS, ceilings, timed, write_csv  # noqa: E402

STACKS = {"attn_in (wq_a wkv weights_proj comp.wkv comp.wgate)": ((1280, 512, 64, 512, 512), 4096),
          "q_b (wq_b indexer.wq_b)": ((32768, 8192), 1280), "wo_b": ((4096,), 4096),
          "shared (gate w1 w3)": ((16, 2304, 2304), 4096), "shared.w2": ((4096,), 2304),
          "indexer.wk": ((128,), 512), "lm_head": ((129280,), 4096)}
"""``(widths, K)`` of the decode linears of ``model=small`` (``configs/model/small.yaml``), stacked
where they read the same input."""
GRID = [dict(block_n=n, block_k=k, warps=w, stages=s)
         for n, (k, w, s) in itertools.product((16, 32, 64), ((128, 4, 4), (256, 4, 4), (512, 4, 3), (512, 8, 3)))]
FIELDS = ("card", "date", "command", "name", "widths", "k", "rows", "kernel", "time_us", "frac_copy_bw",
          "over_cublas")


def main() -> None:
    from deepinfer_backends.sm100.fused.linear_skinny import linear_skinny

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    card = torch.cuda.get_device_name().replace(" ", "_")
    stamp = {"card": card, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "command": " ".join(["python", *sys.argv])}
    bandwidth = ceilings()["copy_bw"]
    g = torch.Generator("cuda").manual_seed(0)
    rows_out, ratios = [], {}
    for name, (widths, k) in STACKS.items():
        w = torch.randn(sum(widths), k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        parts = list(w.split(list(widths)))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            moved = 2 * (w.numel() + rows * (w.shape[0] + k))
            cublas, _ = timed(lambda: [F.linear(x, p) for p in parts])
            want = [F.linear(x, p) for p in parts]
            points = [("cublas", cublas)]
            for tiles in GRID:
                if any(width % tiles["block_n"] for width in widths):
                    continue
                got = linear_skinny(x, parts, tiles)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
                seconds, _ = timed(lambda: linear_skinny(x, parts, tiles))
                label = "triton n{block_n} k{block_k} w{warps} s{stages}".format(**tiles)
                points.append((label, seconds))
                ratios.setdefault(label, {})[(name, rows)] = seconds / cublas
            for label, seconds in points:
                rows_out.append({**stamp, "name": name, "widths": " ".join(map(str, widths)), "k": k, "rows": rows,
                                 "kernel": label, "time_us": round(seconds * 1e6, 2),
                                 "frac_copy_bw": round(moved / seconds / bandwidth, 3),
                                 "over_cublas": round(seconds / cublas, 3)})
            best = min(points[1:], key=lambda p: p[1])
            print(f"{name:<52} K={k:<5} rows={rows:<3} cublas {cublas * 1e6:7.1f} us ({moved / cublas / bandwidth:.2f} bw)"
                  f"  best {best[0]:<26} {best[1] * 1e6:7.1f} us ({moved / best[1] / bandwidth:.2f} bw)", flush=True)
    complete = {label: sum(r.values()) for label, r in ratios.items() if len(r) == len(STACKS) * len(args.rows)}
    for label, total in sorted(complete.items(), key=lambda kv: kv[1])[:5]:
        print(f"over every point: {label:<26} mean time over cuBLAS {total / (len(STACKS) * len(args.rows)):.3f}")
    print("wrote", write_csv(args.out / f"linear_stacked_{card.lower().removeprefix('nvidia_')}.csv", FIELDS, rows_out))


if __name__ == "__main__":
    main()
