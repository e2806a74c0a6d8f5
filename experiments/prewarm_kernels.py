"""Compile, on a machine without a GPU, the sm100 kernels a GPU run compiled, into a TileLang cache
to carry to the next GPU run.

A run with ``DEEPINFER_SM100_COMPILE_LOG=path`` logs each kernel it compiles (``backends/sm100/launch.py``).
TileLang's cache key is the kernel's TIR, the target and its own libraries' hashes, not the GPU, so
with the same tilelang build on both machines (``../shared/tools/pack_tilelang.sh`` packs the
wheel installed here) the entries compiled here are found there. Compiling here runs nvcc on the
CPU machine, which has it.

    DEEPINFER_SM100_COMPILE_LOG=kernels.jsonl python ...          (on the GPU machine)
    TILELANG_CACHE_DIR=DIR python experiments/prewarm_kernels.py kernels.jsonl [...] [--jobs N] [--pack OUT.tar.xz]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def read_logs(paths) -> list[dict]:
    """The logged kernels, each once (arguments back to tuples where JSON made lists)."""
    seen, kernels = set(), []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            entry["args"] = tuple(tuple(a) if isinstance(a, list) else a for a in entry["args"])
            entry["kwargs"] = {k: tuple(v) if isinstance(v, list) else v for k, v in entry["kwargs"].items()}
            key = json.dumps(entry, sort_keys=True)
            if key not in seen:
                seen.add(key)
                kernels.append(entry)
    return kernels


def compile_one(entry: dict) -> str:
    from deepinfer_backends.sm100.launch import compile_kernel

    name = f"{entry['module']}.{entry['factory']}{entry['args']}{entry['kwargs']} {entry['arch']}"
    try:
        compile_kernel(entry["module"], entry["factory"], entry["args"], entry["kwargs"], entry["arch"])
        return f"ok   {name}"
    except Exception as error:  # one kernel that no longer compiles (the code moved on) is reported, not fatal
        return f"FAIL {name}: {type(error).__name__}: {str(error)[:200]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--pack", type=Path, help="also write the cache ($TILELANG_CACHE_DIR) as this .tar.xz")
    args = parser.parse_args()
    cache = os.environ.get("TILELANG_CACHE_DIR")
    if not cache:
        parser.error("set TILELANG_CACHE_DIR to the cache to fill (the GPU run must use the same one)")
    kernels = read_logs(args.logs)
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(compile_one, kernels))
    print("\n".join(results))
    print(f"{sum(r.startswith('ok') for r in results)} of {len(results)} compiled into {cache}")
    if args.pack:
        subprocess.run(["tar", "-cJf", str(args.pack), "-C", cache, "."], check=True)
        print(f"packed {args.pack} ({args.pack.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
