"""The two bf16 grouped GEMM kernels side by side on one GPU: the portable one
(``kernels/grouped_gemm.py``, one CTA per output tile, TileLang's automatic pipeline) and the
warp-specialised one with hand-placed barriers (``kernels/grouped_gemm_ws.py``), on the MoE shapes of
``bench_ops.py`` and a few tile variants.

Per point: each kernel's error against a float32 torch result, its time (CUDA-graph replay,
median of 5 rounds), TFLOP/s, and its ratio to torch's dense bf16 matmul of the same total
FLOPs (``rows x n x k`` in one GEMM) measured in the same run.

    python experiments/grouped_gemm_kernels.py [--only LABEL_PART ...] [--out DIR]

Prints a table and writes ``grouped_gemm_kernels_<card>.csv`` under ``experiments/results/`` or ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import RESULTS, dense_rate, timed, write_csv  # noqa: E402

HIDDEN, INTERMEDIATE, TOP = 4096, 2048, 6
POINTS = [  # (label, experts, rows, n, k): bench_ops's MoE points (384 experts, balanced EP ranks)
    ("EP8 T=16384 w13", 48, 16384 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=16384 w2", 48, 16384 * TOP // 8, HIDDEN, INTERMEDIATE),
    ("EP8 T=4096 w13", 48, 4096 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("EP1 T=4096 w13", 384, 4096 * TOP, 2 * INTERMEDIATE, HIDDEN),
    ("EP8 T=256 w13", 48, 256 * TOP // 8, 2 * INTERMEDIATE, HIDDEN),
    ("dense 8192^3", 1, 8192, 8192, 8192),
]
WS_VARIANTS = {  # name -> tiles of grouped_gemm_bf16_ws
    "ws 128x256 s4": {"block_m": 128, "block_n": 256, "num_stages": 4},
    "ws 128x256 s3": {"block_m": 128, "block_n": 256, "num_stages": 3},
    "ws 64x256 s4": {"block_m": 64, "block_n": 256, "num_stages": 4},
}
FIELDS = ("card", "date", "command", "shape", "kernel", "max_err", "time_us", "tflop_s", "frac_dense_same_flops",
          "frac_dense_8192")


def routed(experts: int, rows: int, n: int, k: int):
    """bench_ops's operands: uniformly random routing (so segments end in partial tiles)."""
    g = torch.Generator("cuda").manual_seed(0)
    sizes = torch.bincount(torch.randint(0, experts, (rows,), device="cuda", generator=g), minlength=experts)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    return x, w, sizes


def reference(x, w, sizes) -> torch.Tensor:
    out, start = torch.empty(x.shape[0], w.shape[1], device=x.device), 0
    for expert, size in enumerate(sizes.tolist()):
        out[start:start + size] = x[start:start + size].float() @ w[expert].float().T
        start += size
    return out


def kernels(experts: int, n: int, k: int, rows: int):
    """name -> callable(x, w, sizes): the portable kernel with the wrapper's tiles, then each variant
    of the warp-specialised one."""
    from deepinfer_backends.sm100 import gemm
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule
    from deepinfer_backends.sm100.launch import compiled

    def launcher(module, factory, tiles):
        kernel = compiled(module, factory, experts, n, k, **tiles)

        def call(x, w, sizes):
            schedule = tile_schedule(sizes, x.shape[0], tiles["block_m"])
            y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
            kernel(x, w, schedule[0], schedule[1], schedule[2], y)
            return y
        return call

    portable = gemm.gemm_tiles(rows, experts, n, k)
    table = {f"portable {portable['block_m']}x{portable['block_n']}":
             launcher("grouped_gemm", "grouped_gemm_bf16", portable)}
    for name, tiles in WS_VARIANTS.items():
        table[name] = launcher("grouped_gemm_ws", "grouped_gemm_bf16_ws", tiles)
    return table


def edge_check() -> None:
    """Every kernel on segments that are empty, shorter than a warpgroup's 64 rows, or end just past a tile."""
    sizes = torch.tensor([0, 1, 63, 64, 65, 128, 129, 300, 0], device="cuda")
    g = torch.Generator("cuda").manual_seed(1)
    n, k = 512, 320
    x = torch.randn(int(sizes.sum()), k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    expected = reference(x, w, sizes)
    for name, call in kernels(len(sizes), n, k, x.shape[0]).items():
        err = ((call(x, w, sizes).float() - expected).abs().max() / expected.abs().max()).item()
        print(f"edge segments {sizes.tolist()} n={n} k={k} {name:18s} max err {err:.1e} "
              f"{'pass' if err < 1e-2 else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="keep points whose label contains one of these")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    card = torch.cuda.get_device_name().replace(" ", "_")
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dense = 2 * 8192 ** 3 / timed(lambda: a @ b, reps=5, graph=False)[0]
    print(f"{card}: dense bf16 8192^3 {dense / 1e12:.0f} TFLOP/s")
    edge_check()
    stamp, command = datetime.datetime.now().isoformat(timespec="minutes"), " ".join(sys.argv)
    rows_out = []
    for label, experts, rows, n, k in POINTS:
        if args.only and not any(part in label for part in args.only):
            continue
        x, w, sizes = routed(experts, rows, n, k)
        expected = reference(x, w, sizes)
        same = dense_rate(rows, n, k)
        flops = 2.0 * rows * n * k
        for name, call in kernels(experts, n, k, rows).items():
            try:
                err = ((call(x, w, sizes).float() - expected).abs().max() / expected.abs().max()).item()
                seconds, _ = timed(lambda: call(x, w, sizes), reps=5)
            except Exception as error:  # a variant that does not fit (shared memory) is reported, not fatal
                print(f"{label:18s} {name:18s} error: {type(error).__name__}: {str(error)[:120]}")
                continue
            row = {"card": card, "date": stamp, "command": command, "shape": f"{label} E={experts} M={rows} N={n} K={k}",
                   "kernel": name, "max_err": err, "time_us": seconds * 1e6, "tflop_s": flops / seconds / 1e12,
                   "frac_dense_same_flops": flops / seconds / same, "frac_dense_8192": flops / seconds / dense}
            rows_out.append(row)
            print(f"{label:18s} {name:18s} err {err:.1e} {row['time_us']:9.1f} us {row['tflop_s']:6.1f} TF/s "
                  f"same-FLOPs dense {same / 1e12:4.0f}: {row['frac_dense_same_flops']:.2f}  "
                  f"8192^3: {row['frac_dense_8192']:.2f}", flush=True)
    path = write_csv(args.out / f"grouped_gemm_kernels_{card.split('_')[-1].lower()}.csv", FIELDS, rows_out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
