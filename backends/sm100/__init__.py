"""The sm100 backend: TileLang kernels for NVIDIA Hopper (sm_90a, measured on H200) and Blackwell
(sm_100a: the same portable kernels lower there; no Blackwell hardware has run them yet).

Importing this package does not import tilelang (about 6 s); the first call of an op does,
and compiles that op's kernel for the shape (kept for the process, and on disk by TileLang)."""
from __future__ import annotations

import torch

from deepinfer.hal.backend import Backend, Capabilities

IMPLEMENTED = ("grouped_gemm", "indexer_logits", "mla_sparse_decode", "mla_sparse_prefill", "rms_norm")
_NOT_YET = "no TileLang kernel yet; set backend.fallback=reference to run the reference on the GPU"
UNSUPPORTED = {
    "linear": "no TileLang kernel yet (dense GEMM goes through grouped_gemm with one expert later); "
              "set backend.fallback=reference",
    "kv_store": "no fused norm/rope/quantize/store kernel yet; " + _NOT_YET,
}


class Sm100Backend(Backend):
    """TileLang kernels for the hot ops; every other op is declared unsupported with a reason.

    Activations are bf16 (float32 inputs are refused with a clear error). grouped_gemm takes
    bf16 operands only so far (FP8 / MXFP4 weights: not yet). mla_sparse_decode reads fp8 or
    bf16 main caches and the fp4 extra cache; it splits the key list over several CTAs when the
    batch is too small to fill the GPU, so it is not batch invariant."""

    name = "sm100"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        fp8=True,
        fp4=False,
        batch_invariant=False,
        notes=(
            "runs on sm_90a (Hopper, measured on H200) and lowers for sm_100a with the same portable "
            "kernels; no Blackwell-specific (tcgen05) variants yet",
            "fp8: the fp8 KV cache format is read natively; FP8 grouped GEMM is not implemented yet",
            "fp4: only the fp4 compressed KV cache is read (decoded to bf16); MXFP4 weights are not",
            "mla_sparse_decode splits the key list across CTAs for small batches (not batch invariant)",
        ),
    )

    def implementations(self):
        from deepinfer_backends.sm100 import wrappers

        return {op: getattr(wrappers, op) for op in IMPLEMENTED}

    def unsupported_reasons(self) -> dict[str, str]:
        import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)
        from deepinfer.hal.spec import SPECS

        return {op: UNSUPPORTED.get(op, _NOT_YET) for op in SPECS if op not in IMPLEMENTED}
