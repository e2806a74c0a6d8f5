"""Compile, on a machine without a GPU, the sm100 kernels a GPU run compiled, into a TileLang cache
to carry to the next GPU run.

A run with ``DEEPINFER_SM100_COMPILE_LOG=path`` logs each kernel it compiles (``backends/sm100/launch.py``).
TileLang's cache key is the kernel's TIR, the target and its own libraries' hashes, not the GPU, so
with the same tilelang build on both machines (``../shared/tools/pack_tilelang.sh`` packs the
wheel installed here) the entries compiled here are found there. Compiling here runs nvcc on the
CPU machine, which has it.

    DEEPINFER_SM100_COMPILE_LOG=kernels.jsonl python ...          (on the GPU machine)
    python experiments/prewarm_kernels.py study.logs=[kernels.jsonl,...] [study.cache_dir=DIR] [study.jobs=2]
        [study.pack=OUT.tar.xz] [study.limit=N]

Prints one line per kernel and writes them to ``prewarm_kernels.csv`` under ``experiments/results/``
or ``study.output_dir``.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from deepinfer.config.schema import ConfigError
from deepinfer.results import write_results
from deepinfer.study import REPO_ROOT, StudySettings, compose_study, study_command


@dataclass
class Settings(StudySettings):
    """The compile logs replayed and the cache they fill."""

    FAST = ("study.logs=[experiments/results/sm100_kernels_engine_h200.jsonl]", "study.limit=1", "study.jobs=1")

    logs: list[str] = field(default_factory=list)
    """Compile logs (JSON lines) to replay; relative paths are from the repository's root."""
    cache_dir: Optional[str] = None
    """TileLang cache to fill (the GPU run must use the same); None: ``$TILELANG_CACHE_DIR``, else a
    temporary folder, removed after ``pack``."""
    jobs: int = 2
    """Processes compiling at once."""
    pack: Optional[str] = None
    """Also write the filled cache as this ``.tar.xz``."""
    limit: Optional[int] = None
    """Replay only the first N distinct kernels."""


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


def compile_one(entry: dict) -> dict:
    """Compile one logged kernel into the cache: ``{status: ok | FAIL, kernel, error}``."""
    from deepinfer_backends.sm100.launch import compile_kernel

    name = f"{entry['module']}.{entry['factory']}{entry['args']}{entry['kwargs']} {entry['arch']}"
    try:
        compile_kernel(entry["module"], entry["factory"], entry["args"], entry["kwargs"], entry["arch"])
        return {"status": "ok", "kernel": name, "error": ""}
    except Exception as error:  # one kernel that no longer compiles (the code moved on) is reported, not fatal
        return {"status": "FAIL", "kernel": name, "error": f"{type(error).__name__}: {str(error)[:200]}"}


@contextlib.contextmanager
def cache_folder(settings: Settings) -> Iterator[str]:
    """The TileLang cache to fill, exported as ``$TILELANG_CACHE_DIR`` to the compiling processes
    while it is open."""
    before = os.environ.get("TILELANG_CACHE_DIR")
    with contextlib.ExitStack() as stack:
        cache = settings.cache_dir or before or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="tilelang_cache_"))
        os.environ["TILELANG_CACHE_DIR"] = cache
        try:
            yield cache
        finally:
            if before is None:
                del os.environ["TILELANG_CACHE_DIR"]
            else:
                os.environ["TILELANG_CACHE_DIR"] = before


def main(argv=None) -> int:
    _, settings = compose_study("prewarm_kernels", Settings, argv)
    if not settings.logs:
        raise ConfigError("give the compile logs to replay: study.logs=[kernels.jsonl,...] (a GPU run with "
                          "DEEPINFER_SM100_COMPILE_LOG=kernels.jsonl writes one)")
    kernels = read_logs(REPO_ROOT / path for path in settings.logs)[:settings.limit]
    with cache_folder(settings) as cache:
        with ProcessPoolExecutor(settings.jobs) as pool:
            rows = list(pool.map(compile_one, kernels))
        for row in rows:
            print(f"{row['status']:4} {row['kernel']}" + (f": {row['error']}" if row["error"] else ""))
        print(f"{sum(row['status'] == 'ok' for row in rows)} of {len(rows)} compiled into {cache}")
        if settings.pack:
            subprocess.run(["tar", "-cJf", settings.pack, "-C", cache, "."], check=True)
            print(f"packed {settings.pack} ({Path(settings.pack).stat().st_size / 1e6:.1f} MB)")
    path = write_results(settings.results_path("prewarm_kernels"), rows, study_command("prewarm_kernels", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
