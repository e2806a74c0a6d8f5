"""Op speed on a GPU against measured ceilings: the sm100 kernels and the reference backend on V4.1 shapes.

One run measures the card's device-to-device copy bandwidth and dense bf16 matmul rate (torch),
then each op point on the backend chosen by the Hydra config (``backend=sm100`` by default) and,
for a few points, on the reference backend. Per point it reports time, achieved GB/s and
TFLOP/s, their ratios to the ceilings and to the roofline floor ``max(bytes / copy_bw,
flops / dense_rate)`` (the dense FP8 rate for FP8 activations, the bf16 one otherwise).
Kernels are compiled first, in parallel processes, so compile time stays out of the run.

    python experiments/bench_ops.py [study.sweep=quick|full] [study.only=[NAME_PART,...]] [study.jobs=N]
        [study.output_dir=DIR] [overrides...]

The backend is the composed one (``backend=sm100``, the study's default, with its ``backend.*``
values). Prints a table and writes ``sm100_ops_<card>.csv`` (e.g. ``sm100_ops_h200.csv``) under
``experiments/results/`` or ``study.output_dir``.
"""
from __future__ import annotations

import multiprocessing
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config.schema import BackendConfig, ConfigError
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_points import POINTS, Point  # noqa: E402

COLUMNS = ("op", "backend", "shape", "time_us", "gb_s", "tflop_s", "frac_copy_bw", "frac_dense_bf16", "frac_dense_fp8",
           "frac_roofline", "fp8", "timing", "note")
"""A row's columns, in the CSV's order."""


@dataclass
class Settings(StudySettings):
    """Which op points run, and how their kernels compile."""

    FAST = ("study.only=[rms_hidden_256,swa_keys_t1]", "study.jobs=1")
    DEVICE = "cuda"

    sweep: str = "quick"
    """``quick`` (the points marked quick) or ``full`` (every point of ``bench_points.POINTS``)."""
    only: list[str] = field(default_factory=list)
    """Keep the points whose name contains one of these (empty: every point of the sweep)."""
    jobs: int = 8
    """Processes compiling the points' kernels before the run (1: none, the timed run compiles)."""

    def __post_init__(self) -> None:
        if self.sweep not in ("quick", "full"):
            raise ConfigError(f"study.sweep={self.sweep!r} is invalid: use quick or full")


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


def dense_rate(rows: int, n: int, k: int, fp8: bool = False) -> float:
    """torch's dense rate at ``rows x n x k`` (the grouped GEMM's total FLOPs in one GEMM): the bf16
    matmul, or with ``fp8`` the e4m3 ``torch._scaled_mm`` (per-tensor scales, bf16 out)."""
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        seconds, _ = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    else:
        seconds, _ = timed(lambda: a @ b.t())
    return 2 * rows * n * k / seconds


def _warm(args: tuple[str, BackendConfig]) -> str:
    """Compile one point's kernels in a child process (fills TileLang's disk cache)."""
    name, backend = args
    try:
        point = POINTS[name]
        fn = point.build(backend_ops(backend))
        fn()
        torch.cuda.synchronize()
        return f"{name}: ok"
    except Exception as error:  # reported, and the point fails again (visibly) in the timed run
        return f"{name}: {type(error).__name__}: {error}"


def backend_ops(backend: BackendConfig):
    """The op table of ``backend`` (a composed ``backend`` section)."""
    from deepinfer.hal import OpTable

    return OpTable(backend.name, backend.fallback, dict(backend.overrides), options=backend.op_options)


def measure(point: Point, ops, backend: str, peaks: dict[str, float]) -> dict:
    """Time one point on one backend and relate it to the ceilings."""
    fn = point.build(ops)
    seconds, how = timed(fn, reps=point.reps, graph=backend != "reference")
    floor = max(point.bytes / peaks["copy_bw"], point.flops / peaks["dense_fp8" if point.fp8 else "dense_bf16"])
    row = {"op": point.op, "backend": backend, "shape": point.shape, "time_us": seconds * 1e6,
           "gb_s": point.bytes / seconds / 1e9, "tflop_s": point.flops / seconds / 1e12,
           "frac_copy_bw": point.bytes / seconds / peaks["copy_bw"],
           "frac_dense_bf16": point.flops / seconds / peaks["dense_bf16"],
           "frac_dense_fp8": point.flops / seconds / peaks["dense_fp8"], "frac_roofline": floor / seconds,
           "timing": how, "note": point.note, "fp8": point.fp8}
    if point.gathered:
        row["note"] = f"{point.note} gathers {point.gathered / 1e9:.2f} GB: {point.gathered / seconds / 1e9:.0f} " \
                      f"GB/s".strip()
    if point.dense_shape is not None:
        same_flops = dense_rate(*point.dense_shape, fp8=point.fp8)
        row["note"] = f"{point.note} torch dense {'fp8' if point.fp8 else 'bf16'} same FLOPs " \
                      f"{same_flops / 1e12:.0f} TFLOP/s; ratio " \
                      f"{point.flops / seconds / same_flops:.2f}".strip()
    return row


def chosen_points(settings: Settings) -> list[str]:
    """The names of the points the run times: the sweep's, narrowed by ``settings.only``."""
    return [name for name, point in POINTS.items() if (settings.sweep == "full" or point.quick)
            and (not settings.only or any(part in name for part in settings.only))]


def ceiling_rows(peaks: dict[str, float]) -> list[dict]:
    """The rows of the measured ceilings."""
    return [{"op": "ceiling", "backend": "torch", "shape": "copy 2 GiB / mm 8192^3", "gb_s": peaks["copy_bw"] / 1e9,
             "tflop_s": peaks["dense_bf16"] / 1e12},
            {"op": "ceiling", "backend": "torch", "shape": "_scaled_mm e4m3 8192^3",
             "tflop_s": peaks["dense_fp8"] / 1e12}]


def point_rows(name: str, backend: BackendConfig, tables: dict, peaks: dict[str, float]) -> list[dict]:
    """Point ``name`` on ``backend`` and, where the point asks for it, on the reference; a failure
    is a row whose note says why."""
    point = POINTS[name]
    rows = []
    for which in (backend.name, "reference") if point.with_reference else (backend.name,):
        try:
            row = measure(point, tables[which], which, peaks)
        except Exception as error:
            row = {"op": point.op, "backend": which, "shape": point.shape,
                   "note": f"FAILED {type(error).__name__}: {str(error)[:300]}"}
        rows.append(_ordered(row))
        print(_line(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    app, settings = compose_study("bench_ops", Settings, argv)
    names = chosen_points(settings)
    if settings.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(settings.jobs) as pool:
            for line in pool.imap_unordered(_warm, [(name, app.backend) for name in names]):
                print("compiled", line, flush=True)
    card = torch.cuda.get_device_name().replace(" ", "_")
    peaks = ceilings()
    print(f"{card}: copy {peaks['copy_bw'] / 1e9:.0f} GB/s, dense bf16 {peaks['dense_bf16'] / 1e12:.0f} TFLOP/s, "
          f"dense fp8 {peaks['dense_fp8'] / 1e12:.0f} TFLOP/s", flush=True)
    rows = [_ordered(row) for row in ceiling_rows(peaks)]
    tables = {app.backend.name: backend_ops(app.backend), "reference": backend_ops(BackendConfig())}
    for name in names:
        rows += point_rows(name, app.backend, tables, peaks)
    path = write_results(settings.results_path(f"sm100_ops_{card.lower().removeprefix('nvidia_')}"), rows,
                         study_command("bench_ops", argv))
    print("\n" + "\n".join(_line(r) for r in rows) + f"\nwrote {path}")
    return 0


def _ordered(row: dict) -> dict:
    """``row`` with every one of :data:`COLUMNS`, in order (empty where it has none)."""
    return {column: row.get(column, "") for column in COLUMNS}


def _line(row: dict) -> str:
    fp8 = row.get("fp8") is True

    def num(key, fmt):
        return format(row[key], fmt) if isinstance(row.get(key), float) else "-"
    return (f"{row['op']:<18} {row['backend']:<9} {row['shape']:<44} {num('time_us', '9.1f')} us "
            f"{num('gb_s', '7.0f')} GB/s {num('tflop_s', '6.1f')} TF/s bw {num('frac_copy_bw', '.2f')} "
            f"tc {num('frac_dense_fp8' if fp8 else 'frac_dense_bf16', '.2f')}{' (fp8)' if fp8 else ''} "
            f"roof {num('frac_roofline', '.2f')} {row.get('note', '')}")


if __name__ == "__main__":
    sys.exit(main())
