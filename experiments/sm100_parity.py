"""The parity grid of one backend on this GPU, with numbers: every op x case against the reference.

Runs the comparison of ``tests/hal/test_parity.py`` (same inputs, seed 0, reference on the CPU,
the op's own tolerance) and prints, per op x case, pass / fail / skipped with the maximum and
mean absolute error of every output. Ops the backend declares unsupported are listed with the
reason.

    python experiments/sm100_parity.py [--backend sm100] [--out DIR] [--ops OP ...]

Writes ``<backend>_parity_<card>.txt`` and ``.csv`` (card, date, command on every row).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import sys
from pathlib import Path

import torch

from deepinfer.hal import SPECS, get_backend
from deepinfer.hal.spec import compare, dtype_skip_reason
from deepinfer.hal.parity import to_device

RESULTS = Path(__file__).parent / "results"
FIELDS = ("card", "date", "command", "op", "case", "status", "max_abs_err", "mean_abs_err", "detail")


def _errors(got, want) -> tuple[float, float]:
    """Largest max and mean absolute error over the float outputs (-inf/-inf pairs count as equal)."""
    pairs = list(zip(got, want)) if isinstance(want, (tuple, list)) else [(got, want)]
    worst_max, worst_mean = 0.0, 0.0
    for g, w in pairs:
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        g, w = g.detach().cpu().double(), w.detach().cpu().double()
        err = (g - w).abs().masked_fill(torch.isinf(w) & (g == w), 0.0)
        worst_max = max(worst_max, err.max().item() if err.numel() else 0.0)
        worst_mean = max(worst_mean, err.mean().item() if err.numel() else 0.0)
    return worst_max, worst_mean


def run_case(backend, op: str, case_name: str) -> dict:
    spec = SPECS[op]
    case = spec.case(case_name)
    reason = dtype_skip_reason(spec, case, backend.capabilities.dtypes)
    if reason:
        return {"status": "skipped", "detail": reason}
    inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    want = spec.reference(**to_device(inputs, torch.device("cpu")))
    try:
        got = backend.implementations()[op](**to_device(inputs, torch.device("cuda")))
        torch.cuda.synchronize()
    except Exception as error:
        return {"status": "error", "detail": f"{type(error).__name__}: {str(error)[:400]}"}
    failures = compare(got, want, spec.case_tolerance(case), f"{op}/{case_name}")
    max_err, mean_err = _errors(got, want)
    return {"status": "fail" if failures else "pass", "max_abs_err": max_err, "mean_abs_err": mean_err,
            "detail": "; ".join(failures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="sm100")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--ops", nargs="+", help="only these ops (default: every op)")
    args = parser.parse_args()
    backend = get_backend(args.backend)
    card = torch.cuda.get_device_name().replace(" ", "_")
    stamp = {"card": card, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "command": " ".join(["python", *sys.argv])}
    rows = []
    for op in sorted(args.ops or SPECS):
        if op not in backend.implementations():
            rows.append({**stamp, "op": op, "case": "*", "status": "unsupported",
                         "detail": backend.unsupported_reasons().get(op, "")})
            continue
        for case in SPECS[op].cases:
            rows.append({**stamp, "op": op, "case": case.name, **run_case(backend, op, case.name)})
            print(_line(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"{args.backend}_parity_{card.lower().removeprefix('nvidia_')}"
    with open(f"{base}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "error", "skipped", "unsupported")}
    text = "\n".join([f"{stamp['card']} {stamp['date']} {stamp['command']}", *map(_line, rows), str(counts)])
    Path(f"{base}.txt").write_text(text + "\n")
    print(text)


def _line(row: dict) -> str:
    errors = (f"max {row['max_abs_err']:.3g} mean {row['mean_abs_err']:.3g}"
              if isinstance(row.get("max_abs_err"), float) else "")
    return f"{row['op']:<20} {row['case']:<24} {row['status']:<11} {errors:<28} {row.get('detail', '')}"


if __name__ == "__main__":
    main()
