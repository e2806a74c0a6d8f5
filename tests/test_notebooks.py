"""Every notebook under notebooks/ runs top to bottom (code cells executed in one namespace,
as a kernel would; no Jupyter installation needed)."""
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    namespace = {"__name__": "__main__"}
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code cells"
    for number, cell in enumerate(cells):
        source = "".join(cell["source"])
        try:
            exec(compile(source, f"{path.name}[cell {number}]", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{path.name} code cell {number} failed: {error!r}\n{source}") from error
