"""``python -m deepinfer model=tiny backend=reference prompt="..."``: the Hydra app.

Composes ``configs/config.yaml`` (the tree and schema :func:`deepinfer.config.compose.compose`
uses), turns it into an :class:`~deepinfer.config.schema.AppConfig` and runs its ``task``."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from deepinfer.config.compose import CONFIG_NAME, HYDRA_VERSION_BASE
from deepinfer.config.schema import to_app_config
from deepinfer.config.store import register_schemas
from deepinfer.models.registry import CONFIG_ROOT

TASKS = ("generate",)

register_schemas()


@hydra.main(config_path=str(CONFIG_ROOT), config_name=CONFIG_NAME, version_base=HYDRA_VERSION_BASE)
def main(cfg: DictConfig) -> None:
    app = to_app_config(cfg)
    if app.task not in TASKS:
        raise SystemExit(f"task={app.task!r} is not available yet; tasks: {list(TASKS)}")
    from deepinfer.engine.llm import run_app

    exit_code = run_app(app)
    if exit_code:
        raise SystemExit(exit_code)


if __name__ == "__main__":
    main()
