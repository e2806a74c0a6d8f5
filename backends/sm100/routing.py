"""sm100 MoE routing: ``moe_gate`` in one Triton kernel (:mod:`.fused.moe_gate`) and the one-rank
``ep_dispatch`` as a GPU counting sort in three (:mod:`.fused.ep_dispatch`); the exchange between
ranks is left to the fallback."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.hal.ops.all_to_all import DispatchHandle, check_routing
from deepinfer.hal.ops.routing import check_gate_args
from deepinfer_backends.sm100.launch import TRITON_INTERPRETED, on_device, require

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 1024
MAX_TOP_K = 32
MAX_PAIRS = 2 ** 30


def moe_gate(logits, bias, top_k, routed_scale):
    """HAL ``moe_gate`` for CUDA ``logits [T, E]`` (float32, or bf16 / fp16 read as float32; ``E``
    at most :data:`MAX_EXPERTS`, ``top_k`` at most :data:`MAX_TOP_K`): ``(weights float32 [T, k],
    ids int64 [T, k])``, one program per few tokens."""
    op = "moe_gate"
    require(on_device(logits), op, "logits must be a CUDA tensor")
    check_gate_args(logits, bias, top_k)
    require(logits.dtype in FLOAT_DTYPES, op, f"logits must be float32, bf16 or fp16, got {logits.dtype}")
    require(bias is None or (on_device(bias) and bias.dtype in FLOAT_DTYPES), op,
            "bias must be a float32, bf16 or fp16 CUDA tensor")
    experts = logits.shape[1]
    require(experts <= MAX_EXPERTS, op, f"E ({experts}) must be at most {MAX_EXPERTS}")
    require(top_k <= MAX_TOP_K, op, f"top_k ({top_k}) must be at most {MAX_TOP_K}")
    import triton
    from deepinfer_backends.sm100.fused.moe_gate import block_tokens, moe_gate_kernel

    tokens = logits.shape[0]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        block_e = triton.next_power_of_2(experts)
        block_t = block_tokens(block_e)
        moe_gate_kernel[(triton.cdiv(tokens, block_t),)](
            logits, logits if bias is None else bias.contiguous(), weights, ids, tokens, experts, logits.stride(0),
            float(routed_scale), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), HAS_BIAS=bias is not None,
            BLOCK_T=block_t, BLOCK_E=block_e, LIBDEVICE=not TRITON_INTERPRETED, num_warps=4)
    return weights, ids


@dataclass(eq=False)
class OneRankDispatch(DispatchHandle):
    """The handle of a one-rank dispatch, with ``row_of_pair`` (int64 ``[T * k]``): each pair's
    expanded row, the inverse of ``pair_index``, written by the placing kernel for ``ep_combine``."""

    row_of_pair: torch.Tensor | None = None


def ep_dispatch(x, topk_ids, topk_weights, num_experts, group=None):
    """HAL ``ep_dispatch`` on one rank (``group`` None or of size 1) for CUDA ``x [T, H]`` (float32,
    bf16 or fp16): ``(expanded [T * k, H], group_sizes int64 [E], handle)`` exactly as the
    reference builds them, by a stable counting sort in three launches, one for few pairs (no host
    sync). Ids outside
    ``[-1, E)`` (which value checks reject) are treated as unrouted."""
    op = "ep_dispatch"
    require(on_device(x) and on_device(topk_ids) and on_device(topk_weights), op,
            "x, topk_ids and topk_weights must be CUDA tensors")
    check_routing(x, topk_ids, topk_weights, num_experts)
    require(group is None or dist.get_world_size(group) == 1, op,
            "only one rank has a kernel; the exchange between ranks runs on the fallback")
    require(x.dtype in FLOAT_DTYPES, op, f"x must be float32, bf16 or fp16, got {x.dtype}")
    require(topk_weights.dtype in FLOAT_DTYPES, op, f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    require(num_experts <= MAX_EXPERTS, op, f"num_experts ({num_experts}) must be at most {MAX_EXPERTS}")
    require(topk_ids.numel() <= MAX_PAIRS, op, f"T * k ({topk_ids.numel()}) must be at most {MAX_PAIRS}")
    import triton
    from deepinfer_backends.sm100.fused import ep_dispatch as kernels

    num_tokens, top_k = topk_ids.shape
    pairs, hidden, device = num_tokens * top_k, x.shape[1], x.device
    expanded = torch.empty(pairs, hidden, dtype=x.dtype, device=device)
    group_sizes = torch.empty(num_experts, dtype=torch.int64, device=device)
    pair_index = torch.empty(pairs, dtype=torch.int64, device=device)
    pair_weights = torch.empty(pairs, dtype=torch.float32, device=device)
    routed = torch.empty(pairs, dtype=torch.int8, device=device)
    expert_order = torch.empty(pairs, dtype=torch.int64, device=device)
    handle = OneRankDispatch(pair_index, pair_weights, None, None, expert_order, num_tokens, top_k, group,
                             routed=routed.view(torch.bool), row_of_pair=torch.empty_like(expert_order))
    if not pairs:
        return expanded, group_sizes.zero_(), handle
    if hidden and x.stride(1) != 1:
        x = x.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    bins = kernels.bin_count(num_experts)
    rows = kernels.place_rows(bins)
    one_block = pairs <= kernels.ONE_BLOCK_PAIRS
    block = triton.next_power_of_2(max(pairs, rows)) if one_block else kernels.block_pairs(pairs, rows)
    blocks = triton.cdiv(pairs, block)
    scratch = torch.empty(2 * blocks * bins + bins, dtype=torch.int32, device=device)
    counts, starts, totals = scratch[:blocks * bins], scratch[blocks * bins:-bins], scratch[-bins:]
    if not one_block:
        kernels.dispatch_count_kernel[(blocks,)](topk_ids, counts, pairs, num_experts, BLOCK_PAIRS=block, BINS=bins,
                                                 num_warps=4)
        kernels.dispatch_scan_kernel[(bins // kernels.SCAN_BINS,)](
            counts, starts, totals, group_sizes, blocks, num_experts, BINS=bins, SCAN_ROWS=kernels.SCAN_ROWS,
            SCAN_BINS=kernels.SCAN_BINS, num_warps=4)
    split_cols = kernels.split_columns(hidden, blocks)
    kernels.dispatch_place_kernel[(blocks, max(1, triton.cdiv(hidden, split_cols)))](
        x, topk_ids, topk_weights, starts, totals, group_sizes, expanded, pair_index, pair_weights, routed,
        expert_order, handle.row_of_pair, pairs, top_k, num_experts, hidden, x.stride(0), split_cols,
        BLOCK_PAIRS=block, ROWS=rows, BINS=bins, BLOCK_H=kernels.BLOCK_H, ONE_BLOCK=one_block, num_warps=4)
    return expanded, group_sizes, handle

