"""Which Ascend generation a device is, and whether the native stack is there, found without
importing ``torch_npu`` until it is asked for (importing it breaks ``import torch`` on machines
without CANN)."""
from __future__ import annotations

import importlib

PLATFORMS = ("A2", "A3", "A5")
"""tilelang-ascend's platform names: A2 (910B), A3 (910C), A5 (950)."""

_DEVICE_NAMES = (("ascend950", "A5"), ("ascend910_93", "A3"), ("ascend910c", "A3"), ("ascend910b", "A2"))
"""Device-name prefixes (lowercase, as ``torch_npu.npu.get_device_name`` reports them) by platform;
the first that matches wins, so the 910C's ``Ascend910_93`` names are checked before the 910B's."""


def platform_of(device_name: str) -> str:
    """The platform (A2, A3, A5) of an NPU device name; an error naming the known ones otherwise."""
    name = device_name.strip().lower().replace(" ", "")
    for prefix, platform in _DEVICE_NAMES:
        if name.startswith(prefix):
            return platform
    raise ValueError(f"unknown Ascend device {device_name!r}: known names start with "
                     f"{[prefix for prefix, _ in _DEVICE_NAMES]} (A5 is the 950 generation)")


def native_status() -> tuple[bool, str]:
    """``(available, reason)`` of the native stack: ``torch_npu`` imports and sees an NPU. Any
    failure of the import (no CANN, a broken install) is a reason, never an exception."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as error:  # torch_npu fails in several ways without CANN: each is a reason
        return False, f"torch_npu does not import ({type(error).__name__}: {error})"
    try:
        count = torch_npu.npu.device_count()
    except Exception as error:
        return False, f"torch_npu imports but cannot count NPUs ({type(error).__name__}: {error})"
    if not count:
        return False, "torch_npu imports but sees no NPU"
    return True, f"{count} NPU(s), {torch_npu.npu.get_device_name(0)}"


def device_platform() -> str:
    """The platform of NPU 0, through ``torch_npu`` (call only where :func:`native_status` says
    the native stack is available)."""
    return platform_of(importlib.import_module("torch_npu").npu.get_device_name(0))
