"""The one way a run's config is made: ``configs/config.yaml`` plus overrides -> :class:`AppConfig`.

``python -m deepinfer`` (a Hydra app on the same config tree and schema) and ``LLM(...)`` both
end in :func:`~deepinfer.config.schema.to_app_config`; this module is the Python-API side."""
from __future__ import annotations

from collections.abc import Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from deepinfer.config.schema import AppConfig, ConfigError, to_app_config
from deepinfer.config.store import register_schemas
from deepinfer.models.registry import CONFIG_ROOT

CONFIG_NAME = "config"
HYDRA_VERSION_BASE = "1.3"


def group_options(group: str) -> list[str]:
    """The options of config group ``group``: the yaml files in ``configs/<group>/``."""
    return sorted(path.stem for path in (CONFIG_ROOT / group).glob("*.yaml"))


def compose(overrides: Sequence[str] = ()) -> AppConfig:
    """Compose ``configs/config.yaml`` with Hydra command-line style ``overrides`` (for example
    ``["model=tiny", "decoding.temperature=0.5"]``) into a validated :class:`AppConfig`.

    Safe to call repeatedly and inside a running Hydra app, whose global state is put back
    afterwards. Raises :class:`ConfigError` (a ``ValueError``) for an unknown group option, an
    unknown key, a value of the wrong type or one out of range."""
    register_schemas()
    app_hydra = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_ROOT), version_base=HYDRA_VERSION_BASE,
                                   job_name="deepinfer"):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except MissingConfigException as error:
        raise _unknown_option_error(error, overrides) from error
    except (HydraException, OmegaConfBaseException) as error:
        raise _composition_error(error, overrides) from error
    finally:
        GlobalHydra.instance().clear()
        if app_hydra is not None:
            GlobalHydra.instance().initialize(app_hydra)
    return to_app_config(cfg)


def _unknown_option_error(error: MissingConfigException, overrides: Sequence[str]) -> ConfigError:
    group, _, option = (error.missing_cfg_file or "").rpartition("/")
    if group == "study":
        return ConfigError(f"experiment={option} is a study with settings of its own: run it with "
                           f"python experiments/{option}.py [study.<key>=...] [overrides...]")
    if not group or not (CONFIG_ROOT / group).is_dir():
        return _composition_error(error, overrides)
    return ConfigError(f"unknown {group} option {option!r}; available: {group_options(group)} "
                       f"(the yaml files in {CONFIG_ROOT / group})")


def _composition_error(error: Exception, overrides: Sequence[str]) -> ConfigError:
    cause = f"\n{error.__cause__}" if error.__cause__ is not None else ""
    return ConfigError(f"cannot compose the config with overrides {list(overrides)}: {error}{cause}")
