"""The decode-time linears of ``model=small`` on one GPU: sm100's TileLang ``linear`` (the grouped
GEMM kernel with one expert, ``backend.options.linear_kernel=tilelang``) beside torch's
``F.linear`` (cuBLAS, what ``linear_kernel=auto`` takes below ``SKINNY_ROWS`` rows), at few rows,
where a GEMM reads its weight once and the copy bandwidth bounds it.

Per shape and row count: each one's time (CUDA-graph replay, median of 5 rounds), the weight
bytes it must read over that time as a share of the copy bandwidth measured in the same run,
and the ratio of the two. Prints a table and writes ``experiments/results/linear_skinny_<card>.csv``.

    python experiments/linear_skinny.py [--rows 1 16 64] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import RESULTS, _op_table, ceilings, timed, write_csv  # noqa: E402

SHAPES = {"wq_a": (1280, 4096), "wq_b": (32768, 1280), "wkv": (512, 4096), "indexer.wq_b": (8192, 1280),
          "weights_proj": (64, 4096), "wo_b": (4096, 4096), "gate": (16, 4096), "shared.w1": (2304, 4096),
          "shared.w2": (4096, 2304), "lm_head": (129280, 4096)}
"""``(N, K)`` of the decode linears of ``model=small`` (``configs/model/small.yaml``)."""
FIELDS = ("card", "date", "command", "name", "n", "k", "rows", "tilelang_us", "cublas_us", "tilelang_frac_copy_bw",
          "cublas_frac_copy_bw", "tilelang_over_cublas")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    card = torch.cuda.get_device_name().replace(" ", "_")
    stamp = {"card": card, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "command": " ".join(["python", *sys.argv])}
    bandwidth = ceilings()["copy_bw"]
    ops = _op_table(["backend.options.linear_kernel=tilelang"], "sm100")
    g = torch.Generator("cuda").manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)
            ours, _ = timed(lambda: ops.linear(x, w))
            theirs, _ = timed(lambda: F.linear(x, w))
            moved = 2 * (n * k + rows * (n + k))
            row = {**stamp, "name": name, "n": n, "k": k, "rows": rows, "tilelang_us": round(ours * 1e6, 2),
                   "cublas_us": round(theirs * 1e6, 2), "tilelang_frac_copy_bw": round(moved / ours / bandwidth, 3),
                   "cublas_frac_copy_bw": round(moved / theirs / bandwidth, 3),
                   "tilelang_over_cublas": round(ours / theirs, 2)}
            rows_out.append(row)
            print(f"{name:<13} N={n:<6} K={k:<5} rows={rows:<3} tilelang {row['tilelang_us']:8.1f} us "
                  f"({row['tilelang_frac_copy_bw']:.2f} bw)  cublas {row['cublas_us']:8.1f} us "
                  f"({row['cublas_frac_copy_bw']:.2f} bw)  tilelang/cublas {row['tilelang_over_cublas']:.2f}",
                  flush=True)
    print("wrote", write_csv(args.out / f"linear_skinny_{card.lower().removeprefix('nvidia_')}.csv", FIELDS, rows_out))


if __name__ == "__main__":
    main()
