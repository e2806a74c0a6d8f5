"""Every study (``configs/experiment/<name>.yaml`` selecting ``/study: <name>``, run by
``experiments/<name>.py``) runs in its fast mode and writes its results the one way: CSV rows
that carry the card, date, commit and a command runnable from the repository, and a real PNG
where the study plots. Kernel studies (``DEVICE = "cuda"``) run only on a GPU, and studies that
download (``DOWNLOADS``) are left to a person."""
import csv
import re
import struct
from pathlib import Path

import pytest
import torch

from deepinfer.config.schema import ConfigError
from deepinfer.study import REPO_ROOT, StudySettings, compose_study, load_script

EXPERIMENTS = REPO_ROOT / "configs" / "experiment"
STUDIES = sorted(path.stem for path in EXPERIMENTS.glob("*.yaml")
                 if re.search(r"^\s*-\s*/study:\s*\S+", path.read_text(), re.M))
META = ["card", "date", "commit", "command"]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_every_experiment_script_is_a_study_or_a_device_script():
    """No script keeps a parallel argparse surface: each one under experiments/ composes the
    configs as a study (or is a helper the run scripts call on the GPU machine)."""
    scripts = {path.stem for path in (REPO_ROOT / "experiments").glob("*.py")}
    with_argparse = sorted(s for s in scripts if "argparse" in (REPO_ROOT / "experiments" / f"{s}.py").read_text())
    assert not with_argparse, f"experiments still parsing flags with argparse: {with_argparse}"
    for name in STUDIES:
        assert name in scripts, f"configs/experiment/{name}.yaml selects a study with no experiments/{name}.py"


SLOW = {"soak": "tests/engine/test_soak.py runs the same fast mode and checks what it counts"}
"""Studies whose fast mode runs only with --runslow, with the test that covers it in the default run."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in STUDIES])
def test_a_study_runs_its_fast_mode_and_writes_its_results(name, tmp_path):
    module = load_script(name)
    settings = module.Settings
    assert issubclass(settings, StudySettings)
    if settings.DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{name} measures GPU kernels; its fast mode needs a CUDA GPU")
    if settings.DOWNLOADS:
        pytest.skip(f"{name} downloads its inputs even in its fast mode; run it by hand")
    argv = ["study.fast=true", f"study.output_dir={tmp_path}"]
    assert not module.main(argv)
    tables = sorted(tmp_path.glob("**/*.csv"))
    assert tables, f"{name} wrote no CSV"
    for table in tables:
        rows = list(csv.DictReader(table.open()))
        assert rows, f"{table.name} has no rows"
        assert list(rows[0])[:4] == META, f"{table.name} columns {list(rows[0])[:6]}"
        for row in rows:
            assert row["command"] == f"python experiments/{name}.py study.fast=true study.output_dir={tmp_path}"
            assert row["date"] and row["commit"] and row["card"]
    pictures = sorted(tmp_path.glob("**/*.png"))
    assert bool(pictures) == settings.PLOTS, f"{name}: PNGs {pictures}, PLOTS={settings.PLOTS}"
    plt = pytest.importorskip("matplotlib.pyplot")
    for picture in pictures:
        width, height = png_size(picture)
        assert width >= 300 and height >= 200, f"{picture.name}: {width} x {height}"
        pixels = plt.imread(picture)
        assert pixels.shape[:2] == (height, width)
        assert pixels.std() > 0.01, f"{picture.name} is blank"


def test_a_misspelt_study_setting_fails_with_hydra_naming_it():
    module = load_script("soak")
    with pytest.raises(ConfigError, match="reqests"):
        compose_study("soak", module.Settings, ["study.reqests=5"])
    with pytest.raises(ConfigError, match="key=value"):
        compose_study("soak", module.Settings, ["--requests", "5"])
