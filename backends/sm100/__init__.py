"""The sm100 backend: TileLang kernels (and Triton for small fused ops) for NVIDIA Hopper (sm_90a)
and Blackwell (sm_100a: the same portable kernels lower there, and tcgen05/TMEM variants of
grouped_gemm and mla_sparse_decode behind ``backend.options.tcgen05=true``; no Blackwell hardware
has run any of them).

Importing this package does not import tilelang (about 6 s) or triton; the first call of an op
does, and compiles that op's kernel for the shape (kept for the process, and on disk by TileLang
or Triton)."""
from __future__ import annotations

import functools

import torch

from deepinfer.hal.backend import Backend, Capabilities
from deepinfer_backends.sm100.options import KernelOptions

IMPLEMENTED = ("apply_rope", "apply_token_bitmask", "compress_tokens", "compressed_decode_layout", "ep_combine",
               "ep_dispatch", "grouped_gemm", "grouped_linear", "grouped_swiglu", "indexer_logits", "indexer_topk",
               "kv_load", "kv_norm_rope_store", "linear", "mhc_head", "mhc_mixes", "mhc_post", "mhc_post_pre",
               "mhc_pre", "mla_sparse_decode", "mla_sparse_prefill", "moe_gate", "moe_route", "quantize_activations",
               "rms_norm", "sample", "speculative_accept", "stacked_linear", "swa_decode_indices", "swa_history_slots",
               "swa_prefill_indices", "swa_ring_slots", "swiglu")
_NOT_YET = "no TileLang kernel yet; set backend.fallback=reference to run the reference on the GPU"
UNSUPPORTED = {
    "candidate_blocks": "candidate-block top-k runs only for configs with candidate_source_layer_id (not V4.1-Flash's "
                        "or model=small's), and has " + _NOT_YET,
    "engram_gate": "Engram runs only for configs with engram_layer_ids (not model=small's), and its gate has "
                   + _NOT_YET,
    "engram_hash": "Engram runs only for configs with engram_layer_ids (not model=small's), and its n-gram hash has "
                   + _NOT_YET,
    "kv_cast": "training rounds keys through a cache format with kv_cast; inference stores them with "
               "kv_norm_rope_store, so kv_cast has " + _NOT_YET,
    "kv_store": "the model stores its SWA, compressed and indexer keys through kv_norm_rope_store (fused kernel "
                "for fp8, bf16, fp4 and index_fp4 rows); a bare kv_store has " + _NOT_YET,
}
INVARIANT = {
    "grouped_gemm": "fixed 64 x 128 tiles whatever the row count; each output element is one wgmma sequence "
                    "over the whole K, in order (no split-K)",
    "linear": "the grouped GEMM kernel with one expert, same fixed tiles (never cuBLAS)",
    "stacked_linear": "linear once per weight (the grouped GEMM kernel with one expert, same fixed tiles)",
    "grouped_linear": "the grouped GEMM kernel on the group-major rows, same fixed tiles (never cuBLAS)",
    "grouped_swiglu": "the two grouped GEMMs with the fixed tiles, then the SwiGLU per element",
    "mla_sparse_decode": "split-KV off: one CTA per query row walks its key lists block by block, in order",
    "mla_sparse_prefill": "the decode kernel on a bf16 key buffer, in decode's key blocks, split-KV off",
    "rms_norm": "one CTA per row, a reduction tree fixed by the row width",
    "indexer_logits": "one CTA per (token, 128-key tile): a wgmma over the head dim, the head sum in a fixed order",
    "kv_norm_rope_store": "one CTA per token: a reduction tree and a quantization fixed by the row width",
    "mhc_mixes": "dot products and squares in fixed 64-token tiles and 256-wide slices of the width, the slices "
                 "added in order; gates and Sinkhorn per token, in tiles fixed for every token count (the two "
                 "launches always, never the one-pass kernel of few tokens)",
    "mhc_head": "the mhc_mixes partials, then per-token gates (two launches always)",
    "apply_rope": "per element: products and sums with the token's table row",
    "ep_combine": "per token: the routed slots are summed in slot order",
    "kv_load": "per token: exact decode",
    "swiglu": "per element",
    "quantize_activations": "per 32 values of a row: their own max and rounding",
    "mhc_pre": "one program per (token, column block), the streams added in order",
    "mhc_post": "one program per (token, column block), the streams added in order",
    "mhc_post_pre": "mhc_post, then per (token, column) the stored streams added in order (with the next input's "
                    "RMSNorm: one program per token, a reduction tree fixed by the row width)",
    "moe_gate": "one program per token: its scores and top-k from its own logits row",
    "moe_route": "moe_gate's per-row picks, then ep_dispatch's stable counting sort; one rank",
    "ep_dispatch": "a stable counting sort: a pair's slot is fixed by the keys before it, in pair order; one rank",
    "compress_tokens": "per (token, channel): the group's softmax over its own members, in member order",
    "indexer_topk": "one program per row: a select over that row's window alone",
    "swa_ring_slots": "integer index arithmetic per element",
    "compressed_decode_layout": "integer index arithmetic per element",
    "swa_decode_indices": "integer index arithmetic per element",
    "swa_prefill_indices": "integer index arithmetic per element",
    "swa_history_slots": "integer index arithmetic per element",
    "sample": "one program per row: its own logits, filters and counter-based draw (float64 CDF of its own row)",
    "speculative_accept": "one program per row: its own distributions and counter-based draws",
    "apply_token_bitmask": "per element: the row's mask bit",
}
"""Ops in the batch-invariant table (``engine.batch_invariant=true``), with the reason each row's
arithmetic does not depend on the batch. Ops not listed go to the fallback (or are refused)."""
KERNEL_CHOICE = ("grouped_gemm", "grouped_linear", "grouped_swiglu", "linear", "mla_sparse_decode",
                 "mla_sparse_prefill", "stacked_linear")
"""Ops whose kernel ``backend.options`` (:class:`~deepinfer_backends.sm100.options.KernelOptions`) picks."""
_INVARIANT_ARGS = {"grouped_gemm": {"batch_invariant": True}, "grouped_linear": {"batch_invariant": True},
                   "grouped_swiglu": {"batch_invariant": True},
                   "linear": {"batch_invariant": True}, "stacked_linear": {"batch_invariant": True},
                   "mla_sparse_decode": {"split_kv": False},
                   "mla_sparse_prefill": {"split_kv": False, "batch_invariant": True},
                   "mhc_mixes": {"batch_invariant": True}, "mhc_head": {"batch_invariant": True}}


class Sm100Backend(Backend):
    """TileLang kernels for the hot ops; every other op is declared unsupported with a reason.

    Activations are bf16 (float32 inputs are refused with a clear error). grouped_gemm takes
    bf16 operands, or FP8 / MXFP4 weights (UE8M0 per 32) beside bf16 or FP8 activations, decoded
    to bf16 in shared memory (float32 result like the reference's, or bf16 when asked for).
    mla_sparse_decode reads fp8 or bf16 main caches and the fp4 extra cache; it splits the key
    list over several CTAs when the batch is too small to fill the GPU. The batch-invariant table
    (:data:`INVARIANT`) turns the split off and fixes the GEMM tiles."""

    name = "sm100"
    options_type = KernelOptions
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        fp8=True,
        fp4=True,
        batch_invariant=True,
        notes=(
            "runs on sm_90a (Hopper) and lowers for sm_100a with the same portable "
            "kernels, which are the default on every arch",
            "tcgen05 variants for grouped_gemm (bf16) and mla_sparse_decode: compiled for sm_100a, not run on "
            "hardware; enable with backend.options.tcgen05=true on Blackwell (set on Hopper, those ops raise)",
            "fp8: the fp8 KV cache and FP8 grouped-GEMM weights (e4m3, UE8M0 per 32) are read as stored and "
            "decoded to bf16 in the kernel (bf16 wgmma, float32 accumulation), FP8 activations once per row "
            "before it on Hopper; backend.options.quant_gemm=native runs FP8 activations on Hopper's FP8 tensor "
            "cores instead (scales moved to one per 128 along K and one per weight column; not exact)",
            "fp4: the fp4 compressed KV cache and MXFP4 expert weights are read as stored (packed e2m1) and "
            "decoded to bf16 in the kernel; grouped-GEMM K a multiple of 128 (beyond 8192 in pieces, added in order)",
            "linear: the Triton kernel for few rows up to 16 rows, cuBLAS above by default (backend.options.linear_kernel), the TileLang GEMM "
            "for block-scaled weights and in batch-invariant mode; grouped_linear: cuBLAS's strided batched GEMM "
            "on bf16 operands where they lie, else the grouped GEMM on group-major copies",
            "mHC (mixes, head, pre, post, post_pre): Triton kernels, float32 math; the mixes' dot products in fixed "
            "slices of the width (a bf16 residual against fn's three bf16 parts), then the gates and every Sinkhorn "
            "iteration in one kernel",
            "stacked_linear (several linears of one input) with at most 16 bf16 rows: one Triton launch streams "
            "every weight (linear_kernel=auto), each product its own contiguous tensor, the query heads' RoPE "
            "(rope_heads) in its epilogue",
            "grouped_gemm and grouped_swiglu with at most 4 rows per expert: a Triton kernel that streams the "
            "weights (the gate and up weights side by side for grouped_swiglu)",
            "batch invariance: split-KV off and fixed GEMM tiles (INVARIANT says why each op qualifies); "
            "measured bitwise end to end on an H200 with the reference fallback for the other ops",
        ),
    )

    def implementations(self, batch_invariant: bool = False):
        from deepinfer_backends.sm100 import wrappers

        if batch_invariant and self.options.linear_kernel == "cublas":
            raise ValueError("backend.options.linear_kernel=cublas cannot serve engine.batch_invariant=true: cuBLAS "
                             "picks its kernel by shape. Use linear_kernel=auto (the TileLang GEMM in that mode) "
                             "or tilelang")
        ops = [op for op in IMPLEMENTED if not batch_invariant or op in INVARIANT]
        return {op: _bound(getattr(wrappers, op), {**({"options": self.options} if op in KERNEL_CHOICE else {}),
                                                   **(_INVARIANT_ARGS.get(op, {}) if batch_invariant else {})})
                for op in ops}

    def unsupported_reasons(self) -> dict[str, str]:
        import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)
        from deepinfer.hal.spec import SPECS

        return {op: UNSUPPORTED.get(op, _NOT_YET) for op in SPECS if op not in IMPLEMENTED}


def _bound(impl, kwargs: dict):
    """``impl`` with ``kwargs`` fixed (name and docstring kept)."""
    if not kwargs:
        return impl
    return functools.update_wrapper(functools.partial(impl, **kwargs), impl)
