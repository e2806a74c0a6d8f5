"""The reference backend: every HAL op's PyTorch ground truth, on any device."""
from __future__ import annotations

import torch

from deepinfer.hal.backend import Backend, Capabilities
from deepinfer.hal.spec import SPECS


class ReferenceBackend(Backend):
    """Runs each op's OpSpec reference (float32 accumulation; quantized formats emulated).

    Its batch-invariant table (:mod:`deepinfer_backends.reference.batch_invariant`) runs the
    same references on fixed-shape row tiles."""

    name = "reference"
    capabilities = Capabilities(
        device_types=frozenset({"cpu", "cuda", "npu"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        fp8=True,
        fp4=True,
        batch_invariant=True,
        collectives=frozenset({"gloo", "nccl", "hccl"}),
        notes=("plain PyTorch; quantized formats are emulated exactly",
               "batch invariance: fixed-shape row tiles, measured bitwise on CPU (AVX2, MKL) and on an H200; "
               "not measured on an NPU"),
    )

    def implementations(self, batch_invariant: bool = False):
        import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)

        if batch_invariant:
            from deepinfer_backends.reference.batch_invariant import batch_invariant_implementations

            return batch_invariant_implementations()
        return {name: spec.reference for name, spec in SPECS.items()}
