"""The reference backend: every HAL op's PyTorch ground truth, on any device."""
from __future__ import annotations

import torch

from deepinfer.hal.backend import Backend, Capabilities
from deepinfer.hal.spec import SPECS


class ReferenceBackend(Backend):
    """Runs each op's OpSpec reference (float32 accumulation; quantized formats emulated)."""

    name = "reference"
    capabilities = Capabilities(
        device_types=frozenset({"cpu", "cuda", "npu"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        fp8=True,
        fp4=True,
        batch_invariant=False,
        collectives=frozenset({"gloo", "nccl", "hccl"}),
        notes=("plain PyTorch; quantized formats are emulated exactly",),
    )

    def implementations(self):
        import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)

        return {name: spec.reference for name, spec in SPECS.items()}
