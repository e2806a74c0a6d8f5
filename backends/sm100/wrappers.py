"""The sm100 op table: each HAL op's wrapper (layout checks, kernel inputs, tile choice) around
its kernel, from the family modules :mod:`.gemm`, :mod:`.attention`, :mod:`.norm` (TileLang)
and :mod:`.mhc`, :mod:`.rope`, :mod:`.routing`, :mod:`.ep_combine`, :mod:`.kv_load`,
:mod:`.activation`, :mod:`.quantize_activations`, :mod:`.compress`, :mod:`.swa_indices`,
:mod:`.indexer_topk`, :mod:`.sampling`, :mod:`.token_bitmask` (Triton); shared compile cache and
refusals in :mod:`.launch`."""
from deepinfer.hal.backend import UnsupportedInput
from deepinfer_backends.sm100.activation import swiglu
from deepinfer_backends.sm100.attention import (
    HEAD_BLOCK, align_lists, indexer_logits, mla_sparse_decode, mla_sparse_prefill, split_count,
)
from deepinfer_backends.sm100.compress import compress_tokens
from deepinfer_backends.sm100.compressed_layout import compressed_decode_layout
from deepinfer_backends.sm100.ep_combine import ep_combine
from deepinfer_backends.sm100.gemm import INVARIANT_TILES, gemm_tiles, grouped_gemm
from deepinfer_backends.sm100.linear import linear
from deepinfer_backends.sm100.grouped_linear import grouped_linear
from deepinfer_backends.sm100.grouped_swiglu import grouped_swiglu
from deepinfer_backends.sm100.kv_load import kv_load
from deepinfer_backends.sm100.launch import compiled
from deepinfer_backends.sm100.mhc import mhc_head, mhc_mixes, mhc_post, mhc_post_pre, mhc_pre
from deepinfer_backends.sm100.norm import KV_STORE_FORMATS, kv_norm_rope_store, rms_norm
from deepinfer_backends.sm100.quantize_activations import quantize_activations
from deepinfer_backends.sm100.rope import apply_rope
from deepinfer_backends.sm100.routing import ep_dispatch, moe_gate, moe_route
from deepinfer_backends.sm100.sampling import sample, speculative_accept
from deepinfer_backends.sm100.stacked_linear import stacked_linear
from deepinfer_backends.sm100.swa_indices import (
    swa_decode_indices, swa_history_slots, swa_prefill_indices, swa_ring_slots,
)
from deepinfer_backends.sm100.token_bitmask import apply_token_bitmask
from deepinfer_backends.sm100.indexer_topk import indexer_topk

__all__ = ["HEAD_BLOCK", "INVARIANT_TILES", "KV_STORE_FORMATS", "UnsupportedInput", "align_lists", "apply_rope",
           "apply_token_bitmask", "compiled", "compress_tokens", "compressed_decode_layout", "ep_combine",
           "ep_dispatch", "gemm_tiles", "grouped_gemm", "grouped_linear", "grouped_swiglu", "indexer_logits",
           "indexer_topk", "kv_load", "kv_norm_rope_store", "linear", "mhc_head", "mhc_mixes", "mhc_post",
           "mhc_post_pre", "mhc_pre", "mla_sparse_decode", "mla_sparse_prefill", "moe_gate", "moe_route",
           "quantize_activations", "rms_norm", "sample", "speculative_accept", "split_count", "stacked_linear",
           "swa_decode_indices", "swa_history_slots", "swa_prefill_indices", "swa_ring_slots", "swiglu"]
