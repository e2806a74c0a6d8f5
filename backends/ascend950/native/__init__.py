"""The ascend950 kernels on an NPU (``backend.execution=native``): one wrapper per op that checks
its inputs, pads them to the kernel's whole tiles as the emulation's plan does, builds the kernel
with the plan's tile sizes and buffer offsets, compiles it with tilelang-ascend for ``pto`` and the
platform (kept by shape, :class:`~deepinfer_backends.ascend950.native.launch.Kernels`), launches it
and drops the padding. Inputs a kernel cannot take are refused with the reason
(:class:`~deepinfer.hal.backend.UnsupportedInput`; ``backend.fallback=reference`` runs them on the
reference). None of this has run on a 950: it is checked on the CPU with a stand-in for
``tilelang`` whose kernels compute with the emulation."""
from __future__ import annotations

import functools
from typing import Callable

from deepinfer_backends.ascend950.native import grouped_gemm, mla, rms_norm, rope
from deepinfer_backends.ascend950.native.launch import Kernels


def implementations(platform: str) -> dict[str, Callable]:
    """The native wrappers, sharing one cache of compiled kernels for ``platform``."""
    kernels = Kernels(platform)
    return {"apply_rope": functools.partial(rope.apply_rope, kernels),
            "grouped_gemm": functools.partial(grouped_gemm.grouped_gemm, kernels),
            "kv_norm_rope_store": functools.partial(rope.kv_norm_rope_store, kernels),
            "mla_sparse_decode": functools.partial(mla.mla_sparse_decode, kernels),
            "mla_sparse_prefill": functools.partial(mla.mla_sparse_prefill, kernels),
            "rms_norm": functools.partial(rms_norm.rms_norm, kernels)}
