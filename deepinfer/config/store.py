"""Registers the config schemas in Hydra's ConfigStore.

``configs/config.yaml`` lists :data:`SCHEMA_NAME` first in its defaults, so composition starts
from a typed :class:`~deepinfer.config.schema.AppConfig`: every group file (``model/*.yaml``,
``backend/*.yaml``, ...) is merged into its group's dataclass and checked against it, and a key
the schema lacks or a value of the wrong type fails with the offending ``group.key``."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from deepinfer.config.schema import AppConfig

SCHEMA_NAME = "deepinfer_schema"


def register_schemas() -> None:
    """Put the schemas in the ConfigStore; idempotent, so every composition may call it."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=AppConfig)
