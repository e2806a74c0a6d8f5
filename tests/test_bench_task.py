"""``python -m deepinfer -m task=bench ...``: a Hydra multirun appends one row per point to one
CSV (each row with its own rerunnable command) and redraws the plots; the rates are the counts
over the measured times."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_multirun_sweep_appends_a_row_per_point_and_plots(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, "-m", "deepinfer", "-m", "task=bench", "bench.batch=1,3",
                          "bench.prompt_tokens=24", "bench.output_tokens=5", "decoding=greedy,dspark",
                          "engine.use_tqdm=false", f"output_dir={out}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert sorted((r["batch"], r["decoding"]) for r in rows) == [("1", "dspark"), ("1", "greedy"), ("3", "dspark"),
                                                                ("3", "greedy")]
    for r in rows:
        batch, prompt = int(r["batch"]), int(r["prompt_tokens"])
        assert float(r["prefill_tok_s"]) == pytest.approx(batch * prompt / float(r["prefill_s"]), rel=1e-3)
        assert float(r["decode_tok_s"]) == pytest.approx(batch * (5 - 1) / float(r["decode_s"]), rel=1e-3)
        assert float(r["tok_s_per_user"]) == pytest.approx(float(r["decode_tok_s"]) / batch, rel=1e-2)
        assert f"bench.batch={batch}" in r["command"] and f"decoding={r['decoding']}" in r["command"]
        assert r["card"] and r["date"] and r["commit"]
    assert all(0 <= float(r["accepted_per_step"]) <= int(r["draft_tokens"]) == 5 for r in rows if r["decoding"] == "dspark")
    assert all(float(r["accepted_per_step"]) == 0 == int(r["draft_tokens"]) for r in rows if r["decoding"] == "greedy")
    pytest.importorskip("matplotlib")
    import matplotlib.image

    image = matplotlib.image.imread(out / "bench.png")
    assert image.ndim == 3 and image.shape[1] > 800


def test_bad_bench_settings_are_refused():
    from deepinfer.config.compose import compose

    with pytest.raises(Exception, match="bench.batch=0 is invalid"):
        compose(["task=bench", "bench.batch=0"])
