"""The experiment configs that are not studies run through ``python -m deepinfer`` in a fast mode:
``tiny_sampled`` generates seeded samples (the same tokens twice), ``engine_sweep`` runs its
Hydra multirun of task=bench over a reduced grid and writes a row per point and its plot."""
import csv
import json
import subprocess
import sys


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "deepinfer", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_tiny_sampled_generates_the_same_seeded_tokens_twice(tmp_path):
    outputs = []
    for attempt in range(2):
        out = tmp_path / f"out{attempt}.json"
        _cli("experiment=tiny_sampled", "prompt=def add(a, b):", "decoding.max_tokens=6", "engine.use_tqdm=false",
             f"output_file={out}", cwd=tmp_path)
        outputs.append([o["token_ids"] for o in json.loads(out.read_text())])
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 6


def test_engine_sweep_runs_its_multirun_on_a_reduced_grid(tmp_path):
    out = tmp_path / "bench"
    _cli("-m", "experiment=engine_sweep", "bench.batch=1,2", "bench.prompt_tokens=16", "bench.output_tokens=3",
         "decoding=greedy", f"output_dir={out}", cwd=tmp_path)
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert sorted(int(r["batch"]) for r in rows) == [1, 2]
    assert all(r["command"].startswith("python -m deepinfer") and "experiment=engine_sweep" in r["command"]
               for r in rows)
    assert (out / "bench.png").stat().st_size > 1000
