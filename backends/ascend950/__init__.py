"""The ascend950 backend: Huawei Ascend 950 (A5) NPUs through tilelang-ascend kernels, and a CPU
emulation of those kernels' plans (``backend.execution=emulate``).

:mod:`~deepinfer_backends.ascend950.kernels` builds RMSNorm, the grouped GEMM (bf16, float32,
FP8), sparse MLA decode (bf16 or FP8 cache), sparse MLA prefill, RoPE and the fused norm-RoPE
store of bf16 keys (bf16, FP8 or index FP4 cache) in tilelang-ascend's language (checked by lowering,
``experiments/ascend_lower.py``). ``execution=native`` serves them through
:mod:`~deepinfer_backends.ascend950.native` where the native stack is available
(:func:`~deepinfer_backends.ascend950.platform.native_status`: ``torch_npu`` imports and sees an
A5 NPU) and says why it cannot run elsewhere; the native path has never run on a 950
(:data:`HARDWARE_VALIDATED`). The emulation serves :data:`EMULATED` ops; with
``backend.fallback=reference`` the rest of a model, and the inputs a kernel refuses, run on the
reference. Importing this module never imports ``torch_npu`` or ``tilelang``."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deepinfer.hal.backend import Backend, Capabilities
from deepinfer_backends.ascend950.platform import PLATFORMS, device_platform, native_status

EXECUTIONS = ("native", "emulate")
EMULATED = ("apply_rope", "grouped_gemm", "kv_norm_rope_store", "mla_sparse_decode", "mla_sparse_prefill", "rms_norm")
"""Ops the emulation implements; the native wrappers serve the same ops."""
HARDWARE_VALIDATED = {op: False for op in EMULATED}
"""Per kernel: whether a run on a 950 has checked it (none has; nor has the native path, which
compiles and launches them, ever run there)."""
NATIVE_PLATFORM = "A5"
"""The platform the native kernels are planned and lowered for."""


@dataclass(frozen=True)
class Ascend950Options:
    """``execution``: ``native`` (tilelang-ascend kernels on an NPU) or ``emulate`` (their plans
    on the CPU); ``platform``: the generation the plans target (A5 is the 950)."""

    execution: str = "native"
    platform: str = "A5"

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise ValueError(f"ascend950 execution={self.execution!r}: use one of {list(EXECUTIONS)}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"ascend950 platform={self.platform!r}: use one of {list(PLATFORMS)}")


class Ascend950Backend(Backend):
    """Ascend 950 kernels; on a CPU, their emulation (every result labelled emulated)."""

    name = "ascend950"
    options_type = Ascend950Options
    capabilities = Capabilities(
        device_types=frozenset({"npu", "cpu"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        fp8=True,
        collectives=frozenset({"hccl"}),
        notes=("npu (backend.execution=native): rms_norm, grouped_gemm (bf16, float32, FP8), mla_sparse_decode "
               "(bf16 or FP8 cache, an FP8 or FP4 extra list), mla_sparse_prefill, apply_rope and "
               "kv_norm_rope_store (every cache format), tilelang-ascend kernels compiled for pto/A5 by shape; other "
               "inputs are refused with the reason",
               "the native wrappers are tested on the CPU with a stand-in for tilelang; they have never compiled "
               "or run on a 950",
               "cpu: an emulation of the kernels' tile plans (backend.execution=emulate), not of the hardware",
               "no kernel has run on a 950 (HARDWARE_VALIDATED)"),
    )

    def __init__(self, options=None):
        super().__init__(options)
        if self.options is None:
            self.options = Ascend950Options()

    @property
    def label(self) -> str:
        """How results of this instance are labelled."""
        return f"ascend950 ({self.options.platform}, emulated)" if self.options.execution == "emulate" \
            else f"ascend950 ({self.options.platform})"

    def implementations(self):
        if self.options.execution == "native":
            available, reason = native_status()
            if not available:
                raise RuntimeError(f"ascend950 cannot run natively here: {reason}. Run its CPU emulation with "
                                   f"backend.execution=emulate, or another backend")
            found = device_platform()
            if self.options.platform != NATIVE_PLATFORM or found != NATIVE_PLATFORM:
                raise RuntimeError(f"the ascend950 native kernels are planned for {NATIVE_PLATFORM} (the 950); this NPU "
                                   f"is {found} and backend.options.platform={self.options.platform}. Run the CPU "
                                   f"emulation with backend.execution=emulate, or another backend")
            from deepinfer_backends.ascend950 import native

            return native.implementations(self.options.platform)
        from deepinfer_backends.ascend950.emulate import apply_rope, grouped_gemm, kv_norm_rope_store, mla, rms_norm

        platform = self.options.platform
        return {"apply_rope": functools.partial(apply_rope.apply_rope, platform=platform),
                "grouped_gemm": functools.partial(grouped_gemm.grouped_gemm, platform=platform),
                "kv_norm_rope_store": functools.partial(kv_norm_rope_store.kv_norm_rope_store, platform=platform),
                "mla_sparse_decode": functools.partial(mla.mla_sparse_decode, platform=platform),
                "mla_sparse_prefill": functools.partial(mla.mla_sparse_prefill, platform=platform),
                "rms_norm": functools.partial(rms_norm.rms_norm, platform=platform)}

    def unsupported_reasons(self):
        from deepinfer.hal.spec import SPECS

        if self.options.execution == "native":
            return {op: f"the ascend950 native kernels serve {list(EMULATED)} so far" for op in SPECS
                    if op not in EMULATED}
        return {op: f"the ascend950 emulation implements {list(EMULATED)} so far" for op in SPECS
                if op not in EMULATED}
