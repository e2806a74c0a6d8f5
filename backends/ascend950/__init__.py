"""The ascend950 backend: Huawei Ascend 950 (A5) NPUs through tilelang-ascend kernels, and a CPU
emulation of those kernels' plans (``backend.execution=emulate``).

:mod:`~deepinfer_backends.ascend950.kernels` builds RMSNorm, the grouped GEMM (bf16, float32,
FP8), sparse MLA decode (bf16 or FP8 cache), sparse MLA prefill, RoPE and the fused norm-RoPE
store of bf16 keys in tilelang-ascend's language (checked by lowering,
``experiments/ascend_lower.py``); the wrappers that compile and launch them on an NPU are not
written, so ``execution=native`` reports why it cannot run (the native stack's status,
:func:`~deepinfer_backends.ascend950.platform.native_status`) and says so.
The emulation serves :data:`EMULATED` ops; with ``backend.fallback=reference`` the rest of a
model runs on the reference. Importing this module never imports ``torch_npu``."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deepinfer.hal.backend import Backend, Capabilities
from deepinfer_backends.ascend950.platform import PLATFORMS, native_status

EXECUTIONS = ("native", "emulate")
EMULATED = ("apply_rope", "grouped_gemm", "kv_norm_rope_store", "mla_sparse_decode", "mla_sparse_prefill", "rms_norm")
"""Ops the emulation implements."""
HARDWARE_VALIDATED = {op: False for op in EMULATED}
"""Per kernel: whether a run on a 950 has checked it (none has)."""


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
        notes=("npu: rms_norm, grouped_gemm (bf16, float32, FP8), mla_sparse_decode (bf16 or FP8 cache), "
               "mla_sparse_prefill, apply_rope and kv_norm_rope_store (bf16 caches) kernels in tilelang-ascend's "
               "language lower to pto/A5; no wrapper compiles or launches them yet",
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
            raise NotImplementedError("launching the ascend950 tilelang-ascend kernels (deepinfer_backends.ascend950."
                                      "kernels) on an NPU is not implemented yet; "
                                      "backend.execution=emulate runs their plans on the CPU")
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
            return {}
        return {op: f"the ascend950 emulation implements {list(EMULATED)} so far" for op in SPECS
                if op not in EMULATED}
