"""Compiling the ascend950 kernels with tilelang-ascend and calling them on NPU tensors.

A kernel is built by its module's builder (:mod:`deepinfer_backends.ascend950.kernels`) from
plain integers and the plan's buffer offsets, compiled by ``tilelang.compile`` for target
``pto`` and the platform (A5 is the 950), and kept by its builder arguments, so each shape
compiles once a process. The compiled kernel is called with the input tensors in the
``prim_func``'s parameter order: parameters listed in ``workspace_idx`` (GM scratch) and
``out_idx`` (results) are left out and allocated by tilelang on the inputs' device, and the
results come back in ``out_idx`` order. tilelang does not check a static shape against the
tensor it is given, so the wrappers check every shape before a launch. ``tilelang`` is imported
at the first compile, never before."""
from __future__ import annotations

import importlib

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer_backends.ascend950.buffers import Buffer, TileBudgetError, layout

TARGET = "pto"
"""tilelang-ascend's code generator for the kernels (``ascendc`` is the other)."""
DEVICE_TYPE = "npu"
"""The torch device type the compiled kernels take their tensors on."""
WAY_AROUND = ("set backend.fallback=reference to run such calls on the reference, or "
              "backend.execution=emulate to run the kernels' plans on the CPU")


def refuse(op: str, reason: str) -> UnsupportedInput:
    """The error for inputs ``op``'s kernel cannot take: the reason and the way around it."""
    return UnsupportedInput(f"ascend950 native {op}: {reason}; {WAY_AROUND}")


def plan_offsets(op: str, buffers: tuple[Buffer, ...], platform: str) -> dict[str, int]:
    """Each buffer's byte offset (:func:`~deepinfer_backends.ascend950.buffers.layout`); a plan
    that does not fit the platform's buffers is refused with the reason."""
    try:
        return layout(buffers, platform)
    except TileBudgetError as error:
        raise refuse(op, f"its tile plan does not fit an AI core: {error}") from None


def check_device(op: str, **tensors: torch.Tensor | None) -> None:
    """Every tensor given lies on the NPU (:data:`DEVICE_TYPE`)."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device.type != DEVICE_TYPE:
            raise ValueError(f"ascend950 native {op} takes {DEVICE_TYPE} tensors, got {name} on {tensor.device}; "
                             f"move the inputs to the NPU, or run backend.execution=emulate on the CPU")


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def padded(tensor: torch.Tensor, shape: tuple[int, ...], fill: float | int = 0) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` holding ``tensor`` in its leading corner and ``fill``
    elsewhere (a fresh copy even when no padding is needed, for kernels that write in place)."""
    out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    out[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return out


def whole(tensor: torch.Tensor, shape: tuple[int, ...], fill: float | int = 0) -> torch.Tensor:
    """``tensor`` as a contiguous tensor of ``shape``: itself when it has that shape already,
    else :func:`padded`."""
    return tensor.contiguous() if tuple(tensor.shape) == tuple(shape) else padded(tensor, shape, fill)


class Kernels:
    """Compiled kernels for ``platform``, one per builder and argument set."""

    def __init__(self, platform: str):
        self.platform = platform
        self.compiled: dict[tuple, object] = {}

    def get(self, module: str, arguments: dict, out_idx: list[int] | None = None,
            workspace_idx: list[int] | None = None):
        """The kernel ``<module>_kernel(**arguments)`` of ``kernels/<module>.py``, compiled on first
        use; ``out_idx`` and ``workspace_idx``: the parameters tilelang allocates."""
        key = (module, tuple(sorted((name, _hashable(value)) for name, value in arguments.items())))
        if key not in self.compiled:
            builder = getattr(importlib.import_module(f"deepinfer_backends.ascend950.kernels.{module}"),
                              f"{module}_kernel")
            func = builder(**arguments)
            import tilelang

            self.compiled[key] = tilelang.compile(func, out_idx=out_idx, workspace_idx=workspace_idx, target=TARGET,
                                                  platform=self.platform)
        return self.compiled[key]


def _hashable(value):
    return tuple(sorted(value.items())) if isinstance(value, dict) else value
