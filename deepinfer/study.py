"""Experiments as Hydra studies: one config surface for the CLI, the notebooks and every script.

A study is a script under ``experiments/`` with a dataclass of its own settings (a subclass of
:class:`StudySettings`) and a delta-only ``configs/experiment/<name>.yaml`` that picks options of
the other groups and sets the values the study needs. The script composes that config with the
command line's overrides, so a run reads like any other::

    python experiments/soak.py study.requests=100 engine.batch_invariant=true decoding=greedy

``study.<key>`` sets the study's own settings, every other key the engine's (model, backend,
parallel, decoding, engine). A misspelt key fails with Hydra's error naming it. ``study.fast=true``
runs the study's fast mode (its ``FAST`` overrides, under any the command line gives): a few
small points on a CPU, which the test suite runs for every study."""
from __future__ import annotations

import importlib.util
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar, Optional, Sequence, TypeVar

from hydra.core.config_store import ConfigStore

from deepinfer.config.compose import compose
from deepinfer.config.schema import AppConfig, ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "experiments" / "results"


@dataclass
class StudySettings:
    """Settings every study has; a study's dataclass adds its own."""

    FAST: ClassVar[tuple[str, ...]] = ()
    """Overrides of the fast mode (``study.fast=true``), applied before the command line's."""
    DEVICE: ClassVar[str] = "cpu"
    """What the fast mode needs: ``cpu`` (any machine) or ``cuda`` (a kernel study; skipped elsewhere)."""
    PLOTS: ClassVar[bool] = False
    """Whether the study draws a PNG beside its CSV."""
    DOWNLOADS: ClassVar[bool] = False
    """Whether even the fast mode downloads (the test suite leaves such a study to a person)."""

    fast: bool = False
    """Run the fast mode: a few small points, for the test suite and a first look."""
    tag: Optional[str] = None
    """Suffix of the result files' names (for example the card: ``h200``)."""
    output_dir: Optional[str] = None
    """Folder of the result files; None: ``experiments/results``."""

    def results_path(self, name: str, suffix: str = ".csv") -> Path:
        """``<output_dir>/<name>[_<tag>]<suffix>``."""
        folder = Path(self.output_dir) if self.output_dir else RESULTS
        return folder / f"{name}{'_' + self.tag if self.tag else ''}{suffix}"


S = TypeVar("S", bound=StudySettings)


def compose_study(name: str, settings: type[S], argv: Sequence[str] | None = None) -> tuple[AppConfig, S]:
    """The run's :class:`AppConfig` and the study's settings (``settings``, checked): ``configs/
    config.yaml`` with ``experiment=<name>`` and ``argv`` (default: the command line). With
    ``study.fast=true`` the study's ``FAST`` overrides come in before ``argv``'s."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bad = [arg for arg in argv if "=" not in arg]
    if bad:
        raise ConfigError(f"{bad}: a study takes Hydra overrides (key=value), for example study.fast=true or "
                          f"model=tiny; its settings: {_keys(settings)}")
    store = ConfigStore.instance()
    store.store(group="study", name=name, node=settings)
    try:  # registered only while the study composes: elsewhere experiment=<name> says how to run it
        app = compose([f"experiment={name}", *argv])
        if not isinstance(app.study, settings):
            raise ConfigError(f"configs/experiment/{name}.yaml must select its settings with '- /study: {name}' "
                              f"in its defaults list")
        if app.study.fast and settings.FAST:
            app = compose([f"experiment={name}", *settings.FAST, *argv])
    finally:
        store.repo.get("study", {}).pop(f"{name}.yaml", None)
    return app, app.study


def study_command(name: str, argv: Sequence[str] | None = None) -> str:
    """The command of this run of study ``name`` (``argv``, default the command line's),
    runnable from the repository's root."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"experiments/{name}.py", *args])


def load_script(name: str) -> ModuleType:
    """Import ``experiments/<name>.py`` (a checkout's, not a package's) as module ``experiments.<name>``."""
    module_name = f"experiments.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = REPO_ROOT / "experiments" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"no experiment script {path} (studies live in a checkout's experiments/)")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve their annotations through it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _keys(settings: type) -> list[str]:
    return [f"study.{key}" for key in settings.__dataclass_fields__]
