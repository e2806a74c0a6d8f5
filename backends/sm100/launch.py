"""What every sm100 wrapper shares: compiling a kernel once per shape key (the first call for a
shape compiles; TileLang's disk cache makes later processes fast; ``tilelang`` is imported on
first use), and refusing inputs the kernels do not cover with
:class:`~deepinfer.hal.backend.UnsupportedInput`.

With ``DEEPINFER_SM100_COMPILE_LOG=path`` each kernel compiled is appended to ``path`` as a JSON
line (module, factory, arguments, arch), which ``experiments/prewarm_kernels.py`` replays on a
machine without a GPU to fill a TileLang cache ahead of a GPU session."""
from __future__ import annotations

import importlib
import json
import os
from collections import OrderedDict
from typing import Any

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer_backends.sm100 import toolchain

_COMPILED: dict[tuple, Any] = {}


COMPILE_LOG = "DEEPINFER_SM100_COMPILE_LOG"


def compiled(module: str, factory: str, *args, **kwargs):
    """The kernel ``kernels.<module>.<factory>(*args, **kwargs)``, compiled for this GPU once."""
    key = (module, factory, args, tuple(sorted(kwargs.items())))
    if key not in _COMPILED:
        arch = toolchain.device_arch()
        _COMPILED[key] = compile_kernel(module, factory, args, kwargs, arch)
        if os.environ.get(COMPILE_LOG):
            with open(os.environ[COMPILE_LOG], "a") as log:
                log.write(json.dumps({"module": module, "factory": factory, "args": args, "kwargs": kwargs,
                                      "arch": arch}, default=repr) + "\n")  # never fails a run
    return _COMPILED[key]


def compile_kernel(module: str, factory: str, args, kwargs: dict, arch: str):
    """``kernels.<module>.<factory>(*args, **kwargs)`` compiled by TileLang for ``arch`` (no GPU needed)."""
    import tilelang

    jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
    return tilelang.compile(jit.get_tir(*args, **kwargs), target=toolchain.target(arch), pass_configs=jit.pass_configs)


_PARAM_COPIES: OrderedDict[tuple[int, str], tuple[torch.Tensor, tuple[int, int], torch.Tensor]] = OrderedDict()
PARAM_COPIES = 4096
"""Most converted copies of parameters :func:`param_copy` keeps (the least recently used go)."""


def param_copy(weight: torch.Tensor, kind: str, convert) -> torch.Tensor:
    """``convert(weight)``, made once per ``nn.Parameter`` and ``kind`` while the parameter is
    unchanged (a weight read by every call of its op in another form would otherwise cost a
    conversion launch each time); other tensors are converted every call. The copy is keyed by
    the parameter itself (held, so its id is never reused by another), its data address and its
    version counter (new data or an in-place change converts again; a write through
    ``weight.data``, which bypasses the counter, is not seen). Nothing is kept while a CUDA graph
    is being captured (a copy made there holds no values until the graph replays)."""
    if not isinstance(weight, torch.nn.Parameter):
        return convert(weight)
    key, state = (id(weight), kind), (weight.data_ptr(), weight._version)
    entry = _PARAM_COPIES.get(key)
    if entry is not None and entry[0] is weight and entry[1] == state:
        _PARAM_COPIES.move_to_end(key)
        return entry[2]
    converted = convert(weight)
    if not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        _PARAM_COPIES[key] = (weight, state, converted)
        while len(_PARAM_COPIES) > PARAM_COPIES:
            _PARAM_COPIES.popitem(last=False)
    return converted


def float32_param(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a contiguous float32 tensor, converted once per parameter (:func:`param_copy`):
    a norm's bf16 weight is read by every call of its op."""
    if weight.dtype == torch.float32 and weight.is_contiguous():
        return weight
    return param_copy(weight, "float32", lambda w: w.detach().float().contiguous())


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


TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Under Triton's interpreter the Triton kernels run on CPU tensors (how the CPU tests run them)."""


def on_device(t) -> bool:
    """``t`` is a tensor the Triton kernels can read: on CUDA, or anywhere under the interpreter."""
    return isinstance(t, torch.Tensor) and (t.is_cuda or TRITON_INTERPRETED)
