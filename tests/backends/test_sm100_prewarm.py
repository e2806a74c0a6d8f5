"""Filling a TileLang cache without a GPU (``experiments/prewarm_kernels.py``): a run with
``DEEPINFER_SM100_COMPILE_LOG`` logs each kernel it compiles once, and replaying the log in another
process, with another cache directory, produces the same cache entry. Needs tilelang and nvcc."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPILE_TWICE = """
from deepinfer_backends.sm100 import launch, toolchain
toolchain.device_arch = lambda device_index=0: toolchain.HOPPER
for _ in range(2):
    launch.compiled("rms_norm", "rms_norm", 96, 1e-6, "float", None, threads=32)
"""


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*/*/kernels/*")}


def test_a_logged_kernel_replays_into_the_same_cache_entry(tmp_path):
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    from deepinfer_backends.sm100 import toolchain

    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    log = tmp_path / "kernels.jsonl"
    env = {**os.environ, "DEEPINFER_SM100_COMPILE_LOG": str(log), "TILELANG_CACHE_DIR": str(tmp_path / "run")}
    subprocess.run([sys.executable, "-c", COMPILE_TWICE], env=env, check=True, capture_output=True, cwd=ROOT)
    lines = log.read_text().splitlines()
    assert len(lines) == 1  # compiled once, logged once
    assert json.loads(lines[0]) == {"module": "rms_norm", "factory": "rms_norm", "args": [96, 1e-6, "float", None],
                                    "kwargs": {"threads": 32}, "arch": toolchain.HOPPER}
    env = {**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "prewarmed")}
    env.pop("DEEPINFER_SM100_COMPILE_LOG", None)
    done = subprocess.run([sys.executable, "experiments/prewarm_kernels.py", f"study.logs=[{log}]", "study.jobs=1",
                           f"study.output_dir={tmp_path}"], env=env, check=True, capture_output=True, text=True,
                          cwd=ROOT)
    assert "1 of 1 compiled" in done.stdout
    assert _entries(tmp_path / "run") == _entries(tmp_path / "prewarmed") != set()
