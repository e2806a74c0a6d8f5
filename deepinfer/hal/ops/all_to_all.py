"""Expert-parallel dispatch and combine: token rows to their experts' owners and back.

Experts are owned in contiguous ranges of ``num_experts / world_size`` (rank ``r`` owns experts
``r * E_local .. (r + 1) * E_local - 1``). Dispatch produces the expanded, expert-contiguous rows
the grouped GEMM consumes; combine sums the expert outputs, weighted by the router, back into
the source tokens' order, or as they are where the experts' side has applied the router weights
(``row_weights``; DeepInfer multiplies them into the SwiGLU's products ahead of the FP8 cast of
the down projection's input). Rows travel with ``torch.distributed.all_to_all_single``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks


@dataclass(eq=False)
class DispatchHandle:
    """What :func:`ep_combine` needs to send expert outputs back and reduce them.

    ``pair_index`` (int64 ``[P]``): the flat index ``token * top_k + slot`` of every routed pair
    this rank sent, in send order (sorted by expert id); ``pair_weights`` (float32 ``[P]``): their
    router weights; ``send_counts`` / ``recv_counts``: rows sent to / received from each rank
    (None on one rank, where nothing is exchanged); ``expert_order`` (int64 ``[M]``): expanded
    row ``i`` is received row ``expert_order[i]``; ``num_tokens`` and ``top_k``: the source
    ``topk_ids`` shape; ``group``: the process group (None: one rank); ``routed`` (bool ``[P]``,
    None when every pair is routed): which pairs carry an expert's output (the others are
    skipped by combine, whatever their rows hold); ``row_weights`` (float32 ``[M]``): the router
    weight of each expanded row, in expanded order (a row that carries no routed pair: any
    value), travelled with the rows across ranks."""

    pair_index: torch.Tensor
    pair_weights: torch.Tensor
    send_counts: list[int] | None
    recv_counts: list[int] | None
    expert_order: torch.Tensor
    num_tokens: int
    top_k: int
    group: Any = None
    routed: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None


def ep_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                group=None) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each routed (token, expert) row to the expert's owner, expert-contiguous.

    ``x [T, H]``, ``topk_ids int64 [T, k]`` (global expert ids, ``-1``: not routed, skipped),
    ``topk_weights float32 [T, k]``. Returns ``expanded [M, H]`` (``x.dtype``): on one rank
    (``group`` None or of size 1) ``M = T * k``: the row ``x[t]`` once per slot, sorted stably by
    expert id (within an expert: token order, then slot order), the unrouted slots last, past
    the last expert's segment; on several ranks the rows this rank's experts received, sorted
    stably by local expert (within an expert: source rank, then token, then slot). Also returns
    ``group_sizes int64 [E_local]`` (rows per local expert; they sum to the routed rows) and the
    :class:`DispatchHandle` for :func:`ep_combine`. ``num_experts`` must divide by the world
    size. On one rank no shape depends on the routing and nothing is read on the host."""
    check_routing(x, topk_ids, topk_weights, num_experts)
    world, rank = _world(group)
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} does not divide over {world} ranks; expert "
                         f"parallelism needs the same number of experts on every rank")
    if world == 1:
        return _dispatch_local(x, topk_ids, topk_weights, num_experts, group)
    local_experts = num_experts // world
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    routed = torch.nonzero(flat_ids >= 0).squeeze(1)
    pair_index = routed[torch.sort(flat_ids[routed], stable=True).indices]
    pair_experts = flat_ids[pair_index]
    send_counts = torch.bincount(pair_experts // local_experts, minlength=world)
    recv_counts = _exchange_counts(send_counts, group)
    send_counts = send_counts.tolist()
    rows = _exchange(x[pair_index // top_k], send_counts, recv_counts, group)
    local_ids = _exchange(pair_experts, send_counts, recv_counts, group) - rank * local_experts
    expert_order = torch.sort(local_ids, stable=True).indices
    pair_weights = topk_weights.reshape(-1)[pair_index].float()
    row_weights = _exchange(pair_weights, send_counts, recv_counts, group)[expert_order]
    handle = DispatchHandle(pair_index, pair_weights, send_counts, recv_counts, expert_order, num_tokens, top_k,
                            group, row_weights=row_weights)
    return rows[expert_order], torch.bincount(local_ids, minlength=local_experts), handle


def _dispatch_local(x, topk_ids, topk_weights, num_experts, group):
    """One rank: every slot becomes a row (static shapes), unrouted slots sorted past the experts."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    sort_key = torch.where(flat_ids >= 0, flat_ids, num_experts)
    pair_index = torch.sort(sort_key, stable=True).indices
    group_sizes = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    group_sizes = group_sizes.scatter_add_(0, sort_key, torch.ones_like(sort_key))[:num_experts]
    expert_order = torch.arange(pair_index.numel(), device=x.device)
    pair_weights = topk_weights.reshape(-1)[pair_index].float()  # expanded row i is pair i
    handle = DispatchHandle(pair_index, pair_weights, None, None, expert_order, num_tokens, top_k, group,
                            routed=(flat_ids >= 0)[pair_index], row_weights=pair_weights)
    return x[pair_index // top_k], group_sizes, handle


def ep_combine(y: torch.Tensor, handle: DispatchHandle, add: torch.Tensor | None = None,
               weighted: bool = True) -> torch.Tensor:
    """Send expert outputs back and reduce them per source token (plus ``add``, when given).

    ``y [M, H]`` is in :func:`ep_dispatch`'s expanded order (rows past the experts' segments are
    ignored). Returns ``out [T, H]`` in ``y.dtype`` with ``out[t] = sum over the token's routed
    slots j, in slot order, of topk_weights[t, j] * (its expert's output row)``, accumulated in
    float32 starting from zero; tokens without routed slots get zeros. ``weighted=False`` sums
    the rows as they are (their router weights applied already, from ``handle.row_weights``).
    With ``add`` (``[T, H]``, float; the MoE's shared expert) the result is
    ``out.to(add.dtype) + add``, in ``add.dtype``."""
    check_combine_rows(y, handle)
    check_combine_add(add, handle.num_tokens, y.shape[1])
    if handle.send_counts is None:
        returned = y
    else:
        received = torch.empty_like(y)
        received[handle.expert_order] = y
        returned = _exchange(received, handle.recv_counts, handle.send_counts, handle.group)
    hidden = y.shape[1]
    rows = returned.float() * handle.pair_weights[:, None] if weighted else returned.float()
    if handle.routed is not None:
        rows = torch.where(handle.routed[:, None], rows, 0.0)
    per_slot = torch.zeros(handle.num_tokens * handle.top_k, hidden, dtype=torch.float32, device=y.device)
    per_slot = per_slot.index_copy(0, handle.pair_index, rows).view(handle.num_tokens, handle.top_k, hidden)
    out = torch.zeros(handle.num_tokens, hidden, dtype=torch.float32, device=y.device)
    for slot in range(handle.top_k):
        out += per_slot[:, slot]
    return out.to(y.dtype) if add is None else out.to(y.dtype).to(add.dtype) + add


def check_combine_add(add: torch.Tensor | None, tokens: int, hidden: int) -> None:
    """``add`` is None or a float ``[tokens, hidden]``."""
    if add is not None and (add.shape != (tokens, hidden) or not add.is_floating_point()):
        raise ValueError(f"add must be a float [T={tokens}, H={hidden}] tensor, got {add.dtype} {tuple(add.shape)}")


def check_combine_rows(y: torch.Tensor, handle: DispatchHandle) -> None:
    """``y`` is ``[M, H]`` with the expanded rows of the dispatch that made ``handle``."""
    if y.ndim != 2 or y.shape[0] != handle.expert_order.numel():
        raise ValueError(f"y must be [M, H] with M={handle.expert_order.numel()} rows (the expanded rows "
                         f"of the dispatch that made this handle), got {tuple(y.shape)}")


def check_routing(x, topk_ids, topk_weights, num_experts) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if topk_ids.dtype != torch.int64 or topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be int64 [T={x.shape[0]}, k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must match topk_ids {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    if value_checks() and topk_ids.numel() and (topk_ids.min() < -1 or topk_ids.max() >= num_experts):
        raise ValueError(f"topk_ids must lie in [-1, {num_experts}) (-1: not routed); seen "
                         f"[{topk_ids.min().item()}, {topk_ids.max().item()}]")


def _world(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _exchange_counts(send_counts: torch.Tensor, group) -> list[int]:
    if _world(group)[0] == 1:
        return send_counts.tolist()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts.tolist()


def _exchange(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    if _world(group)[0] == 1:
        return rows
    received = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    return received


def _routing(gen: torch.Generator, tokens: int, top_k: int, num_experts: int, unrouted: int):
    """Distinct experts per token, weights summing to one; the last ``unrouted`` tokens are padding."""
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k).indices
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True)
    ids[tokens - unrouted:] = -1
    return ids, weights


def _dispatch_case(tokens, hidden, top_k, num_experts, unrouted=0, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        x = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
        ids, weights = _routing(gen, tokens, top_k, num_experts, unrouted)
        return {"x": x.to(device), "topk_ids": ids.to(device), "topk_weights": weights.to(device),
                "num_experts": num_experts}
    return make


def _combine_case(tokens, hidden, top_k, num_experts, unrouted=0, dtype=torch.float32, add_dtype=None,
                  weighted=True):
    """``add_dtype``: pass an ``add`` of that dtype (the shared expert's output); ``weighted=False``:
    the rows carry their router weights already."""
    dispatch_inputs = _dispatch_case(tokens, hidden, top_k, num_experts, unrouted, dtype)

    def make(gen: torch.Generator, device: torch.device):
        expanded, _, handle = ep_dispatch(**dispatch_inputs(gen, device))
        y = torch.randn(expanded.shape, generator=gen, dtype=dtype).to(device)
        args = {"y": y, "handle": handle}
        if add_dtype is not None:
            args["add"] = torch.randn(tokens, hidden, generator=gen).to(device, add_dtype)
        if not weighted:
            args["weighted"] = False
        return args
    return make


register(OpSpec(
    name="ep_dispatch",
    summary="expert-parallel dispatch: expanded, expert-contiguous rows on the experts' owners",
    reference=ep_dispatch,
    cases=(
        OpCase("tiny", _dispatch_case(5, 16, 2, 4)),
        OpCase("tiny_padding", _dispatch_case(6, 8, 3, 8, unrouted=2)),
        OpCase("tiny_bf16", _dispatch_case(4, 32, 2, 6, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_routing", _dispatch_case(64, 4096, 6, 384), "real"),
    ),
))

register(OpSpec(
    name="ep_combine",
    summary="expert-parallel combine: router-weighted sum of expert outputs per source token",
    reference=ep_combine,
    cases=(
        OpCase("tiny", _combine_case(5, 16, 2, 4)),
        OpCase("tiny_padding", _combine_case(6, 8, 3, 8, unrouted=2)),
        OpCase("tiny_bf16", _combine_case(4, 32, 2, 6, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_routing", _combine_case(64, 4096, 6, 384), "real"),
        OpCase("tiny_bf16_add", _combine_case(4, 32, 2, 6, unrouted=1, dtype=torch.bfloat16, add_dtype=torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("tiny_float32_y_bf16_add", _combine_case(5, 40, 3, 6, add_dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_routing_add", _combine_case(16, 4096, 6, 16, dtype=torch.bfloat16, add_dtype=torch.bfloat16),
               "real", dtype=torch.bfloat16),
        OpCase("tiny_unweighted", _combine_case(6, 8, 3, 8, unrouted=2, weighted=False)),
        OpCase("tiny_unweighted_bf16_add", _combine_case(5, 40, 3, 6, dtype=torch.bfloat16, add_dtype=torch.bfloat16,
                                                         weighted=False), dtype=torch.bfloat16),
    ),
))
