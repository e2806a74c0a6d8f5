"""Op speed on a GPU against measured ceilings: the sm100 kernels and the reference backend on V4.1 shapes.

One run measures the card's device-to-device copy bandwidth and dense bf16 matmul rate (torch),
then each op point on the backend chosen by the Hydra config (``backend=sm100`` by default) and,
for a few points, on the reference backend. Per point it reports time, achieved GB/s and
TFLOP/s, their ratios to the two ceilings and to the roofline floor ``max(bytes / copy_bw,
flops / dense_rate)``. Kernels are compiled first, in parallel processes, so compile time stays
out of the run.

    python experiments/bench_ops.py [--sweep quick|full] [--only NAME_PART ...] [--jobs N] [--out DIR]
        [hydra overrides...]

Prints a table and writes ``sm100_ops_<card>.csv`` (e.g. ``sm100_ops_h200.csv``) (card, date, command on every row) under
``experiments/results/`` or ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import multiprocessing
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_points import POINTS, Point  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FIELDS = ("card", "date", "command", "op", "backend", "shape", "time_us", "gb_s", "tflop_s", "frac_copy_bw",
          "frac_dense_bf16", "frac_dense_fp8", "frac_roofline", "timing", "note")


def timed(fn, reps: int = 20, rounds: int = 5, graph: bool = True) -> tuple[float, str]:
    """Median seconds per call: CUDA-graph replay of ``reps`` calls when ``graph`` and the op can
    be captured (hides launch gaps), else back-to-back eager calls timed with events."""
    fn()
    torch.cuda.synchronize()
    run, how = (lambda: [fn() for _ in range(reps)]), "eager"
    if graph:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured, stream=stream):
                for _ in range(reps):
                    fn()
            run, how = captured.replay, "graph"
        except Exception:  # not capturable (host syncs, allocator use): stay eager
            torch.cuda.synchronize()
    run()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(samples), how


def ceilings() -> dict[str, float]:
    """Measured device-to-device copy bandwidth (bytes read + written per second), dense bf16
    matmul rate and dense FP8 e4m3 rate (``torch._scaled_mm``, per-tensor scales, bf16 out), both
    8192^3 on random data."""
    g = torch.Generator("cuda").manual_seed(0)
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_(generator=g)
    dst = torch.empty_like(src)
    copy_s, _ = timed(lambda: dst.copy_(src), reps=5, graph=False)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    mm_s, _ = timed(lambda: a @ b, reps=5, graph=False)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8_s, _ = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                     reps=5, graph=False)
    return {"copy_bw": 2 * src.numel() / copy_s, "dense_bf16": 2 * 8192 ** 3 / mm_s, "dense_fp8": 2 * 8192 ** 3 / fp8_s}


def dense_rate(rows: int, n: int, k: int) -> float:
    """torch's bf16 matmul rate at ``rows x n x k`` (the grouped GEMM's total FLOPs in one GEMM)."""
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g)
    seconds, _ = timed(lambda: a @ b)
    return 2 * rows * n * k / seconds


def _warm(args: tuple[str, tuple, str]) -> str:
    """Compile one point's kernels in a child process (fills TileLang's disk cache)."""
    name, overrides, backend = args
    try:
        point = POINTS[name]
        ops = _op_table(overrides, backend)
        fn = point.build(ops)
        fn()
        torch.cuda.synchronize()
        return f"{name}: ok"
    except Exception as error:  # reported, and the point fails again (visibly) in the timed run
        return f"{name}: {type(error).__name__}: {error}"


def _op_table(overrides, backend: str):
    from deepinfer.config.compose import compose
    from deepinfer.hal import OpTable

    cfg = compose(list(overrides) + [f"backend={backend}"])
    return OpTable(cfg.backend.name, cfg.backend.fallback, dict(cfg.backend.overrides),
                   options=cfg.backend.op_options)


def measure(point: Point, ops, backend: str, peaks: dict[str, float]) -> dict:
    """Time one point on one backend and relate it to the ceilings."""
    fn = point.build(ops)
    seconds, how = timed(fn, reps=point.reps, graph=backend != "reference")
    floor = max(point.bytes / peaks["copy_bw"], point.flops / peaks["dense_bf16"])
    row = {"op": point.op, "backend": backend, "shape": point.shape, "time_us": seconds * 1e6,
           "gb_s": point.bytes / seconds / 1e9, "tflop_s": point.flops / seconds / 1e12,
           "frac_copy_bw": point.bytes / seconds / peaks["copy_bw"],
           "frac_dense_bf16": point.flops / seconds / peaks["dense_bf16"],
           "frac_dense_fp8": point.flops / seconds / peaks["dense_fp8"], "frac_roofline": floor / seconds,
           "timing": how, "note": point.note}
    if point.gathered:
        row["note"] = f"{point.note} gathers {point.gathered / 1e9:.2f} GB: {point.gathered / seconds / 1e9:.0f} " \
                      f"GB/s".strip()
    if point.dense_shape is not None:
        same_flops = dense_rate(*point.dense_shape)
        row["note"] = f"{point.note} torch dense same FLOPs {same_flops / 1e12:.0f} TFLOP/s; ratio " \
                      f"{point.flops / seconds / same_flops:.2f}".strip()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", default="quick", choices=("quick", "full"))
    parser.add_argument("--jobs", type=int, default=8, help="processes compiling kernels before the run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--backend", default="sm100")
    parser.add_argument("--only", nargs="+", help="only points whose name contains one of these strings")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the app config")
    args = parser.parse_args()
    names = [n for n, p in POINTS.items() if (args.sweep == "full" or p.quick)
             and (not args.only or any(part in n for part in args.only))]
    card = torch.cuda.get_device_name().replace(" ", "_")
    stamp = {"card": card, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "command": " ".join(["python", *sys.argv])}
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for line in pool.imap_unordered(_warm, [(n, tuple(args.overrides), args.backend) for n in names]):
                print("compiled", line, flush=True)
    peaks = ceilings()
    print(f"{card}: copy {peaks['copy_bw'] / 1e9:.0f} GB/s, dense bf16 {peaks['dense_bf16'] / 1e12:.0f} TFLOP/s, "
          f"dense fp8 {peaks['dense_fp8'] / 1e12:.0f} TFLOP/s", flush=True)
    rows = [{**stamp, "op": "ceiling", "backend": "torch", "shape": "copy 2 GiB / mm 8192^3",
             "gb_s": peaks["copy_bw"] / 1e9, "tflop_s": peaks["dense_bf16"] / 1e12},
            {**stamp, "op": "ceiling", "backend": "torch", "shape": "_scaled_mm e4m3 8192^3",
             "tflop_s": peaks["dense_fp8"] / 1e12}]
    tables = {args.backend: _op_table(args.overrides, args.backend), "reference": _op_table(args.overrides, "reference")}
    for name in names:
        point = POINTS[name]
        for backend in (args.backend, "reference") if point.with_reference else (args.backend,):
            try:
                row = measure(point, tables[backend], backend, peaks)
            except Exception as error:
                row = {"op": point.op, "backend": backend, "shape": point.shape,
                       "note": f"FAILED {type(error).__name__}: {str(error)[:300]}"}
            rows.append({**stamp, **row})
            print(_line(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    path = write_csv(args.out / f"sm100_ops_{card.lower().removeprefix('nvidia_')}.csv", FIELDS, rows)
    print("\n" + "\n".join(_line(r) for r in rows) + f"\nwrote {path}")


def write_csv(path: Path, fields, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts keyed by ``fields``) to ``path`` with a header, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _line(row: dict) -> str:
    def num(key, fmt):
        return format(row[key], fmt) if isinstance(row.get(key), float) else "-"
    return (f"{row['op']:<18} {row['backend']:<9} {row['shape']:<44} {num('time_us', '9.1f')} us "
            f"{num('gb_s', '7.0f')} GB/s {num('tflop_s', '6.1f')} TF/s bw {num('frac_copy_bw', '.2f')} "
            f"tc {num('frac_dense_bf16', '.2f')} roof {num('frac_roofline', '.2f')} {row.get('note', '')}")


if __name__ == "__main__":
    main()
