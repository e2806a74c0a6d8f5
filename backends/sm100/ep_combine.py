"""sm100 ``ep_combine`` on one rank: each token's routed slots summed in one Triton kernel
(:mod:`.fused.ep_combine`); an exchange across ranks is left to the fallback."""
from __future__ import annotations

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer.hal.ops.all_to_all import check_combine_add, check_combine_rows
from deepinfer_backends.sm100.launch import on_device, require


def ep_combine(y, handle, add=None, weighted=True):
    """HAL ``ep_combine`` for a CUDA ``y [M, H]`` of a one-rank dispatch; ``[T, H]`` in ``y.dtype``
    (in ``add.dtype`` with ``add``, added in the same kernel); ``weighted=False`` sums the rows as
    they are."""
    op = "ep_combine"
    require(on_device(y), op, "y must be a CUDA tensor")
    check_combine_rows(y, handle)
    check_combine_add(add, handle.num_tokens, y.shape[1])
    require(add is None or on_device(add), op, "add must be a CUDA tensor")
    if handle.send_counts is not None or handle.pair_index.numel() != handle.num_tokens * handle.top_k:
        raise UnsupportedInput(f"{op}: only a one-rank dispatch (every slot a row) has an sm100 kernel; the "
                               f"exchange between ranks has none yet; set backend.fallback=reference to run it")
    from deepinfer_backends.sm100.fused.ep_combine import BLOCK_HIDDEN, ep_combine_kernel

    tokens, hidden = handle.num_tokens, y.shape[1]
    out = torch.empty(tokens, hidden, dtype=y.dtype if add is None else add.dtype, device=y.device)
    if not tokens or not hidden:
        return out.zero_() if add is None else out.copy_(add)
    row_of_pair = getattr(handle, "row_of_pair", None)
    if row_of_pair is None:  # a handle of another backend's dispatch
        row_of_pair = torch.empty(tokens * handle.top_k, dtype=torch.int64, device=y.device)
        row_of_pair[handle.pair_index] = handle.expert_order  # every pair of a one-rank dispatch has a row
    routed = handle.routed.contiguous().view(torch.int8) if handle.routed is not None else row_of_pair
    ep_combine_kernel[(tokens, -(-hidden // BLOCK_HIDDEN))](
        y.contiguous(), row_of_pair, handle.pair_weights.float().contiguous(), routed,
        out if add is None else add.contiguous(), out, hidden, TOP_K=handle.top_k,
        HAS_ROUTED=handle.routed is not None, HAS_ADD=add is not None, WEIGHTED=weighted, BLOCK=BLOCK_HIDDEN,
        num_warps=4)
    return out
