from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.hal.ops.all_to_all import ep_combine, ep_dispatch
from deepinfer.hal.spec import SPECS, compare
from tests.hal.oracle import as_float64, check_against_oracle


def dispatch_float64(x, topk_ids, topk_weights, num_experts):
    """Sort the (expert, token, slot) triples in Python and gather the rows; one rank keeps a row
    per unrouted slot too, after the experts' segments, in (token, slot) order."""
    pairs = [(e, t, j) for t, row in enumerate(topk_ids.tolist()) for j, e in enumerate(row)]
    triples = sorted(p for p in pairs if p[0] >= 0) + [p for p in pairs if p[0] < 0]
    expanded = torch.stack([x[t] for _, t, _ in triples]) if triples else x[:0]
    group_sizes = torch.zeros(num_experts, dtype=torch.int64)
    for e, _, _ in triples:
        if e >= 0:
            group_sizes[e] += 1
    return expanded, group_sizes


def combine_float64(y, handle, add=None, weighted=True):
    """Walk the expanded rows back through the handle's documented maps; sum per token, weighted
    unless told (plus ``add``)."""
    out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float64)
    for row, received in enumerate(handle.expert_order.tolist()):
        if handle.routed is not None and not handle.routed[received]:
            continue
        token = handle.pair_index[received].item() // handle.top_k
        out[token] += (handle.pair_weights[received].item() if weighted else 1.0) * y[row]
    return out if add is None else out + add


def test_combine_adds_after_rounding_to_the_outputs_dtype():
    # One token, one slot of weight 1: 1 + 2^-8 rounds to 1 in bf16 (a tie, to even) before the add
    # of 2^-9, and 1 + 2^-9 rounds to 1 again; adding in float32 first would give 1 + 2^-7.
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    expanded, _, handle = ep_dispatch(x, torch.tensor([[0]]), torch.tensor([[1.0]]), 1)
    y = torch.full((1, 2), 1 + 2 ** -8, dtype=torch.float32)
    out = ep_combine(y, handle, add=torch.full((1, 2), 2 ** -9, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.float().tolist() == [[1.0, 1.0]]
    with pytest.raises(ValueError, match=r"add must be a float \[T=1, H=2\]"):
        ep_combine(y, handle, add=torch.zeros(2, 2))


@pytest.mark.parametrize("case", [c.name for c in SPECS["ep_dispatch"].cases])
def test_ep_dispatch_matches_float64(case):
    spec = SPECS["ep_dispatch"]
    inputs = spec.case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    expanded, group_sizes, _ = ep_dispatch(**inputs)
    want_expanded, want_sizes = dispatch_float64(**as_float64(inputs))
    failures = compare((expanded.double(), group_sizes), (want_expanded, want_sizes),
                       spec.tolerance(torch.float64), f"ep_dispatch[{case}]")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", [c.name for c in SPECS["ep_combine"].cases])
def test_ep_combine_matches_float64(case):
    check_against_oracle("ep_combine", case, combine_float64)


def test_row_weights_are_each_expanded_rows_router_weight_and_unweighted_combine_sums_rows_as_they_are():
    # the by-hand routing below: rows (expert, token, slot) = (0,0,1) (0,1,0) (1,2,0) (2,0,0) (2,2,1), then (1,1)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    ids = torch.tensor([[2, 0], [0, -1], [1, 2]])
    weights = torch.tensor([[0.75, 0.25], [1.0, 0.0], [0.5, 0.5]])
    expanded, _, handle = ep_dispatch(x, ids, weights, num_experts=3)
    assert handle.row_weights[:5].tolist() == [0.25, 1.0, 0.5, 0.75, 0.5]
    weighted_rows = expanded * handle.row_weights[:, None]
    out = ep_combine(weighted_rows, handle, weighted=False)
    assert torch.equal(out, ep_combine(expanded, handle))
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))


def test_round_trip_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    ids = torch.tensor([[2, 0], [0, -1], [1, 2]])
    weights = torch.tensor([[0.75, 0.25], [1.0, 0.0], [0.5, 0.5]])
    expanded, sizes, handle = ep_dispatch(x, ids, weights, num_experts=3)
    assert torch.equal(expanded, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [1.0, 2.0], [5.0, 6.0],
                                               [3.0, 4.0]]))
    assert sizes.tolist() == [2, 1, 2]
    expert_ids = torch.tensor([0.0, 0.0, 1.0, 2.0, 2.0, float("nan")])
    out = ep_combine(expanded * (expert_ids + 1)[:, None], handle)
    assert torch.equal(out, torch.tensor([[2.5, 5.0], [3.0, 4.0], [12.5, 15.0]]))


def test_round_trip_passes_rows_through_exactly(gen):
    """Dyadic weights summing to 1 on bf16-valued rows: every partial sum is exact in float32."""
    inputs = SPECS["ep_dispatch"].case("v41_routing").make_inputs(gen, torch.device("cpu"))
    inputs["x"] = inputs["x"].bfloat16().float()
    inputs["topk_weights"] = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]).expand(64, 6)
    expanded, _, handle = ep_dispatch(**inputs)
    assert torch.equal(ep_combine(expanded, handle), inputs["x"])


def test_unrouted_tokens_are_skipped_and_combine_to_zero():
    """On one rank every slot keeps a row (static shapes): the unrouted ones after the segments,
    where whatever a grouped GEMM leaves in them (here NaN) never reaches the combined output."""
    x = torch.ones(2, 4)
    expanded, sizes, handle = ep_dispatch(x, torch.tensor([[1, 0], [-1, -1]]), torch.ones(2, 2), num_experts=2)
    assert expanded.shape == (4, 4) and sizes.tolist() == [1, 1]
    expanded[2:] = float("nan")
    assert torch.equal(ep_combine(expanded, handle), torch.tensor([[2.0] * 4, [0.0] * 4]))


def test_bad_inputs_are_rejected():
    x, weights = torch.zeros(2, 4), torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, 4\).*\[0, 4\]"):
        ep_dispatch(x, torch.tensor([[0, 4], [1, 2]]), weights, num_experts=4)
    with pytest.raises(ValueError, match="topk_ids must be int64"):
        ep_dispatch(x, torch.zeros(2, 2, dtype=torch.int32), weights, num_experts=4)
    with pytest.raises(ValueError, match="topk_weights must match"):
        ep_dispatch(x, torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 3), num_experts=4)
    _, _, handle = ep_dispatch(x, torch.zeros(2, 2, dtype=torch.int64), weights, num_experts=4)
    with pytest.raises(ValueError, match=r"M=4 rows.*\(3, 4\)"):
        ep_combine(torch.zeros(3, 4), handle)


NUM_EXPERTS, TOP_K, HIDDEN, WORLD = 8, 3, 16, 2


def rank_inputs(rank: int):
    """Different tokens (and token counts) per rank, some of them padding."""
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = 5 + 4 * rank
    ids = torch.rand(tokens, NUM_EXPERTS, generator=gen).topk(TOP_K).indices
    ids[-1] = -1
    return torch.randn(tokens, HIDDEN, generator=gen), ids, torch.rand(tokens, TOP_K, generator=gen)


def fake_experts(expanded, group_sizes, first_expert):
    """Expert e multiplies its rows by e + 1 (rows past the segments: one rank's unrouted slots)."""
    rows = torch.arange(expanded.shape[0])
    expert_ids = first_expert + torch.searchsorted(group_sizes.cumsum(0), rows, right=True)
    return expanded * (expert_ids + 1).float()[:, None]


def dispatch_experts_combine(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        x, ids, weights = rank_inputs(rank)
        expanded, sizes, handle = ep_dispatch(x, ids, weights, NUM_EXPERTS, group=dist.group.WORLD)
        y = fake_experts(expanded, sizes, rank * len(sizes))
        out = ep_combine(y, handle)
        out_unweighted = ep_combine(y * handle.row_weights[:, None], handle, weighted=False)
        torch.save({"expanded": expanded, "sizes": sizes, "out": out, "out_unweighted": out_unweighted,
                    "row_weights": handle.row_weights}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_two_ranks_match_one_process(tmp_path):
    mp.spawn(dispatch_experts_combine, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    inputs = [rank_inputs(rank) for rank in range(WORLD)]
    for result, (x, ids, weights) in zip(results, inputs):
        expanded, sizes, handle = ep_dispatch(x, ids, weights, NUM_EXPERTS)
        assert torch.equal(result["out"], ep_combine(fake_experts(expanded, sizes, 0), handle))
        # the router weights, applied on the experts' side, give the same products and sums
        assert torch.equal(result["out_unweighted"], result["out"])
    all_expanded, all_sizes, all_handle = ep_dispatch(*(torch.cat(parts) for parts in zip(*inputs)), NUM_EXPERTS)
    per_rank_rows = all_sizes.view(WORLD, -1).sum(dim=1).tolist()
    routed_rows = all_expanded[:sum(per_rank_rows)]
    routed_weights = all_handle.row_weights[:sum(per_rank_rows)].split(per_rank_rows)
    for result, rows, sizes, weights in zip(results, routed_rows.split(per_rank_rows), all_sizes.view(WORLD, -1),
                                            routed_weights):
        assert torch.equal(result["sizes"], sizes)
        assert torch.equal(result["expanded"], rows)
        assert torch.equal(result["row_weights"], weights)
