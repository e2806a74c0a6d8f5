"""``python -m deepinfer task=parity``: the batch-invariant reference against the plain one passes
(the check CI runs) and writes its table with the run's card, date, commit and command, and a
real heat map; a backend whose op is wrong fails that op's rows with its errors, and the command
exits 1; bad arguments are refused."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.config.compose import compose
from deepinfer.hal import SPECS, Backend, Capabilities, register_backend, unregister_backend
from deepinfer.tasks.parity import run_parity

ROOT = Path(__file__).resolve().parents[1]


def test_batch_invariant_reference_against_reference_passes_and_is_recorded(tmp_path):
    run = subprocess.run([sys.executable, "-m", "deepinfer", "task=parity", "backend_a=reference",
                          "backend_b=reference", "batch_invariant_b=true", "sizes=[tiny]", "generate_tokens=8",
                          f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "0 failed" in run.stdout and "100.0% of 32 tokens agree" in run.stdout
    rows = list(csv.DictReader((tmp_path / "parity.csv").open()))
    tiny_cases = sum(case.size == "tiny" for spec in SPECS.values() for case in spec.cases)
    assert len([r for r in rows if r["op"] != "generate"]) == tiny_cases
    assert {r["status"] for r in rows if r["op"] != "generate"} == {"pass"}
    assert all(r["command"].startswith("python -m deepinfer task=parity") and r["date"] and r["commit"]
               and r["card"] for r in rows)
    pytest.importorskip("matplotlib")
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "parity.png")
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300


class OffByOne(Backend):
    """rms_norm off by 1e-2 everywhere, the reference elsewhere."""

    name = "off_by_one"
    capabilities = Capabilities(device_types=frozenset({"cpu"}), dtypes=frozenset({torch.float32, torch.bfloat16}))

    def implementations(self):
        reference = SPECS["rms_norm"].reference

        def rms_norm(*args, **kwargs):
            out = reference(*args, **kwargs)
            return tuple(t + 1e-2 for t in out) if isinstance(out, tuple) else out + 1e-2
        return {"rms_norm": rms_norm, "swiglu": SPECS["swiglu"].reference}


def test_a_wrong_op_fails_its_rows_and_the_run(tmp_path, capsys):
    register_backend(OffByOne)
    try:
        app = compose(["task=parity", "backend_b=off_by_one", "ops=[rms_norm,swiglu,apply_rope]", "generate_tokens=0",
                       f"output_dir={tmp_path}"])
        assert run_parity(app) == 1
    finally:
        unregister_backend("off_by_one")
    rows = list(csv.DictReader((tmp_path / "parity.csv").open()))
    status = {(r["op"], "bf16" in r["case"]): set() for r in rows}
    for r in rows:
        status[r["op"], "bf16" in r["case"]].add(r["status"])
    # 1e-2 is out of the float32 tolerance (1e-4) and within bf16's (2e-2)
    assert status == {("rms_norm", False): {"fail"}, ("rms_norm", True): {"pass"}, ("swiglu", False): {"pass"},
                      ("swiglu", True): {"pass"}, ("apply_rope", False): {"skip"}, ("apply_rope", True): {"skip"}}
    assert all(float(r["max_error"]) == pytest.approx(1e-2, rel=1e-2) for r in rows if r["op"] == "rms_norm"
               and "bf16" not in r["case"])
    assert "does not implement the op" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    (["task=parity"], "give backend_b=NAME"),
    (["task=parity", "backend_b=reference", "ops=[no_such_op]"], "unknown ops"),
    (["task=train"], "is not available yet"),
    (["task=parity", "sizes=[huge]"], "list case sizes among tiny, real"),
])
def test_bad_parity_arguments_are_refused(overrides, message):
    with pytest.raises(Exception, match=message):
        run_parity(compose(overrides + ["generate_tokens=0"]))
