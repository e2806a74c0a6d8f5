"""sm100 MoE routing: ``moe_gate`` in one Triton kernel (:mod:`.fused.moe_gate`), the one-rank
``ep_dispatch`` as a GPU counting sort in three (:mod:`.fused.ep_dispatch`), and ``moe_route``, both
in one launch for a decode step's few pairs (:mod:`.fused.moe_route`); the exchange between ranks
is left to the fallback."""
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
    _check_dispatch(op, x, num_experts, topk_ids.numel(), group)
    require(topk_weights.dtype in FLOAT_DTYPES, op, f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    import triton
    from deepinfer_backends.sm100.fused import ep_dispatch as kernels

    num_tokens, top_k = topk_ids.shape
    pairs, hidden = num_tokens * top_k, x.shape[1]
    expanded, group_sizes, handle = _dispatch_outputs(x, num_tokens, top_k, num_experts, group)
    if not pairs:
        return expanded, group_sizes.zero_(), handle
    x = _rows(x)
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    bins = kernels.bin_count(num_experts)
    rows = kernels.place_rows(bins)
    one_block = pairs <= kernels.ONE_BLOCK_PAIRS
    block = triton.next_power_of_2(max(pairs, rows)) if one_block else kernels.block_pairs(pairs, rows)
    blocks = triton.cdiv(pairs, block)
    scratch = torch.empty(2 * blocks * bins + bins, dtype=torch.int32, device=x.device)
    counts, starts, totals = scratch[:blocks * bins], scratch[blocks * bins:-bins], scratch[-bins:]
    if not one_block:
        kernels.dispatch_count_kernel[(blocks,)](topk_ids, counts, pairs, num_experts, BLOCK_PAIRS=block, BINS=bins,
                                                 num_warps=4)
        kernels.dispatch_scan_kernel[(bins // kernels.SCAN_BINS,)](
            counts, starts, totals, group_sizes, blocks, num_experts, BINS=bins, SCAN_ROWS=kernels.SCAN_ROWS,
            SCAN_BINS=kernels.SCAN_BINS, num_warps=4)
    split_cols = kernels.split_columns(hidden, blocks)
    kernels.dispatch_place_kernel[(blocks, max(1, triton.cdiv(hidden, split_cols)))](
        x, topk_ids, topk_weights, starts, totals, group_sizes, expanded, *_handle_fields(handle), pairs, top_k,
        num_experts, hidden, x.stride(0), split_cols, BLOCK_PAIRS=block, ROWS=rows, BINS=bins,
        BLOCK_H=kernels.BLOCK_H, ONE_BLOCK=one_block, num_warps=4)
    return expanded, group_sizes, handle


def moe_route(x, logits, bias, top_k, routed_scale, group=None):
    """HAL ``moe_route`` for CUDA ``x [T, H]`` and ``logits [T, E]``: ``(weights, ids, expanded,
    group_sizes, handle)``. One rank with at most ``ONE_BLOCK_PAIRS`` pairs: one launch
    (:func:`.fused.moe_route.moe_route_kernel`); otherwise :func:`moe_gate` then :func:`ep_dispatch`."""
    op = "moe_route"
    require(on_device(x) and on_device(logits), op, "x and logits must be CUDA tensors")
    check_gate_args(logits, bias, top_k)
    from deepinfer_backends.sm100.fused import ep_dispatch as kernels

    tokens, experts = logits.shape
    if x.dim() != 2 or x.shape[0] != tokens:
        raise ValueError(f"{op}: x must be [T={tokens}, H], got {tuple(x.shape)}")
    if tokens * top_k > kernels.ONE_BLOCK_PAIRS or (group is not None and dist.get_world_size(group) > 1) \
            or not tokens:
        weights, ids = moe_gate(logits, bias, top_k, routed_scale)
        return (weights, ids) + ep_dispatch(x, ids, weights, experts, group)
    require(logits.dtype in FLOAT_DTYPES, op, f"logits must be float32, bf16 or fp16, got {logits.dtype}")
    require(bias is None or (on_device(bias) and bias.dtype in FLOAT_DTYPES), op,
            "bias must be a float32, bf16 or fp16 CUDA tensor")
    require(top_k <= MAX_TOP_K, op, f"top_k ({top_k}) must be at most {MAX_TOP_K}")
    _check_dispatch(op, x, experts, tokens * top_k, group)
    import triton
    from deepinfer_backends.sm100.fused.moe_gate import block_tokens
    from deepinfer_backends.sm100.fused.moe_route import moe_route_kernel

    pairs, hidden = tokens * top_k, x.shape[1]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    expanded, group_sizes, handle = _dispatch_outputs(x, tokens, top_k, experts, group)
    x, logits = _rows(x), logits if logits.stride(1) == 1 else logits.contiguous()
    bins = kernels.bin_count(experts)
    rows = kernels.place_rows(bins)
    block_e = triton.next_power_of_2(experts)
    split_cols = kernels.split_columns(hidden, 1)
    programs = max(1, triton.cdiv(hidden, split_cols))
    picked_ids = torch.empty(programs, pairs, dtype=torch.int64, device=x.device)
    picked_weights = torch.empty(programs, pairs, dtype=torch.float32, device=x.device)
    moe_route_kernel[(programs,)](
        x, logits, logits if bias is None else bias.contiguous(), weights, ids, picked_ids, picked_weights,
        group_sizes, expanded, *_handle_fields(handle), tokens, experts, logits.stride(0), float(routed_scale),
        hidden, x.stride(0), split_cols, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), HAS_BIAS=bias is not None,
        GATE_T=block_tokens(block_e), BLOCK_E=block_e, LIBDEVICE=not TRITON_INTERPRETED,
        BLOCK_PAIRS=triton.next_power_of_2(max(pairs, rows)), ROWS=rows, BINS=bins, BLOCK_H=kernels.BLOCK_H,
        num_warps=4)
    return weights, ids, expanded, group_sizes, handle


def _check_dispatch(op: str, x, num_experts: int, pairs: int, group) -> None:
    require(group is None or dist.get_world_size(group) == 1, op,
            "only one rank has a kernel; the exchange between ranks runs on the fallback")
    require(x.dtype in FLOAT_DTYPES, op, f"x must be float32, bf16 or fp16, got {x.dtype}")
    require(num_experts <= MAX_EXPERTS, op, f"num_experts ({num_experts}) must be at most {MAX_EXPERTS}")
    require(pairs <= MAX_PAIRS, op, f"T * k ({pairs}) must be at most {MAX_PAIRS}")


def _dispatch_outputs(x, tokens: int, top_k: int, num_experts: int, group):
    """Empty ``(expanded, group_sizes, handle)`` of a dispatch of ``tokens * top_k`` pairs."""
    pairs, device = tokens * top_k, x.device
    expanded = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=device)
    group_sizes = torch.empty(num_experts, dtype=torch.int64, device=device)
    pair_index = torch.empty(pairs, dtype=torch.int64, device=device)
    pair_weights = torch.empty(pairs, dtype=torch.float32, device=device)
    routed = torch.empty(pairs, dtype=torch.int8, device=device)
    expert_order = torch.empty(pairs, dtype=torch.int64, device=device)
    handle = OneRankDispatch(pair_index, pair_weights, None, None, expert_order, tokens, top_k, group,
                             routed=routed.view(torch.bool), row_weights=pair_weights,  # row r is pair r
                             row_of_pair=torch.empty_like(expert_order))
    return expanded, group_sizes, handle


def _handle_fields(handle: OneRankDispatch) -> tuple:
    """The handle's tensors the placing kernels write, in their argument order."""
    return (handle.pair_index, handle.pair_weights, handle.routed.view(torch.int8), handle.expert_order,
            handle.row_of_pair)


def _rows(x):
    return x.contiguous() if x.shape[1] and x.stride(1) != 1 else x
