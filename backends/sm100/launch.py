"""What every sm100 wrapper shares: compiling a kernel once per shape key (the first call for a
shape compiles; TileLang's disk cache makes later processes fast; ``tilelang`` is imported on
first use), and refusing inputs the kernels do not cover with
:class:`~deepinfer.hal.backend.UnsupportedInput`."""
from __future__ import annotations

import importlib
from typing import Any

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer_backends.sm100 import toolchain

_COMPILED: dict[tuple, Any] = {}


def compiled(module: str, factory: str, *args, **kwargs):
    """The kernel ``kernels.<module>.<factory>(*args, **kwargs)``, compiled for this GPU once."""
    key = (module, factory, args, tuple(sorted(kwargs.items())))
    if key not in _COMPILED:
        import tilelang

        jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
        _COMPILED[key] = tilelang.compile(jit.get_tir(*args, **kwargs), target=toolchain.target(toolchain.device_arch()),
                                          pass_configs=jit.pass_configs)
    return _COMPILED[key]


def require(condition: bool, op: str, message: str) -> None:
    """Raise :class:`UnsupportedInput` for ``op`` with ``message`` (and the ways around it) unless ``condition``."""
    if not condition:
        raise UnsupportedInput(f"sm100 {op}: {message}; set backend.fallback=reference to run such calls on the "
                               f"reference backend, or run the op there always (+backend.overrides.{op}=reference)")


def cuda_bf16(op: str, name: str, t: torch.Tensor) -> None:
    """Refuse ``t`` (argument ``name`` of ``op``) unless it is a bfloat16 CUDA tensor."""
    require(isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.bfloat16, op,
             f"{name} must be a bfloat16 CUDA tensor, got "
             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__} on "
             f"{t.device if isinstance(t, torch.Tensor) else '-'}")
