"""The wheel's explicit package list names every package of the tree (a package left out
installs nowhere but in an editable checkout)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_in_the_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    roots = {name: ROOT / path for name, path in project["tool"]["setuptools"]["package-dir"].items()}
    found = {name + "".join("." + part for part in init.parent.relative_to(path).parts)
             for name, path in roots.items() for init in path.rglob("__init__.py")}
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
