"""One writer for every result file: a CSV whose rows carry the run's card, date, git commit and
command (runnable from the repository), with a PNG beside it where a plot helps."""
from __future__ import annotations

import csv
import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch


def card() -> str:
    """The accelerator the run used (its name), else the CPU's architecture."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {platform.machine()}"


def git_commit(where: Path | None = None) -> str:
    """The checkout's short commit (``+dirty`` with uncommitted changes); ``unknown`` outside git."""
    where = where or Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def command_line(module: str | None = None) -> str:
    """This process's command as it would be typed: ``python -m module args`` or ``python script args``."""
    args = sys.argv[1:]
    head = f"python -m {module}" if module else f"python {sys.argv[0]}"
    return " ".join([head, *(shlex.quote(a) for a in args)])


def pyplot():
    """matplotlib's ``pyplot`` drawing off-screen (Agg), or None, with a note, where matplotlib is
    not installed (it comes with the ``experiments`` and ``dev`` extras)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'deepinfer[experiments]')")
        return None
    return plt


def save_figure(fig, path: Path | str) -> Path:
    """Save ``fig`` as a PNG of its own size (inches x 100 dpi, no cropping) and close it."""
    path = Path(path).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_results(path: Path | str, rows: Iterable[Mapping[str, Any]], command: str, append: bool = False) -> Path:
    """Write ``rows`` to the CSV ``path`` (folders made), each prefixed with the run's card, date,
    commit and ``command``; with ``append``, after the rows ``path`` holds (each keeps its own).
    The columns are the union of the rows' keys, in first-seen order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"card": card(), "date": datetime.date.today().isoformat(), "commit": git_commit(), "command": command}
    earlier = list(csv.DictReader(path.open())) if append and path.exists() else []
    rows = earlier + [{**meta, **row} for row in rows]
    columns = list(dict.fromkeys([*meta, *(key for row in rows for key in row)]))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path
