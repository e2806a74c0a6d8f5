"""Model architectures by name, and the bundled model presets under configs/model/."""
from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"
ARCHITECTURES = ("deepseek_v41",)


def model_preset(name: str) -> dict[str, Any]:
    """The ``configs/model/<name>.yaml`` preset as a plain dict."""
    from omegaconf import OmegaConf

    path = CONFIG_ROOT / "model" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (CONFIG_ROOT / "model").glob("*.yaml"))
        raise ValueError(f"unknown model {name!r}; bundled models: {known}, or pass a checkpoint directory")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def build_config(preset: dict[str, Any]):
    """The architecture config object of a model preset dict."""
    if preset.get("arch") not in ARCHITECTURES:
        raise ValueError(f"unknown model architecture {preset.get('arch')!r}; known: {list(ARCHITECTURES)}")
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config.from_dict(preset["config"])
