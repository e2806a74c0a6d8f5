"""EPLB's policy against hand-worked placements and on skewed synthetic loads: the hot experts get
the replicas, every rank gets its slots, and the largest rank load over the mean falls (the ratios
before and after are printed with -s)."""
import pytest
import torch

from deepinfer.parallel.eplb import (LoadWindow, allocate_replicas, place_replicas, rebalance, replica_of,
                                     static_placement)


def test_hand_worked_allocation_and_placement():
    """Loads 8, 4, 2, 2 on 6 slots over 2 ranks. Allocation: an extra replica of expert 0 leaves
    a largest load of 4 (expert 1's 8 otherwise), then experts 0 and 1 tie at 4 and the lower id
    takes it: replicas 3, 1, 1, 1. Placement by per-replica load (4, then 8/3 three times, 2, 2):
    expert 1 on rank 0 (a tie), expert 0 twice on rank 1 (largest 4, then 16/3 against 20/3), then
    rank 0 (20/3 against 8), expert 2 on rank 1 (22/3 against 26/3), expert 3 on rank 0 (full 1)."""
    loads = torch.tensor([[8.0, 4.0, 2.0, 2.0]])
    replicas = allocate_replicas(loads, 6)
    assert replicas.tolist() == [3, 1, 1, 1]
    placement = place_replicas(loads, replicas, 2)
    assert placement.physical_to_logical.tolist() == [1, 0, 3, 0, 0, 2]
    assert placement.logical_count.tolist() == [3, 1, 1, 1]
    assert placement.logical_to_physical.tolist() == [[1, 3, 4], [0, -1, -1], [5, -1, -1], [2, -1, -1]]
    assert torch.allclose(placement.rank_loads(loads), torch.tensor([[26 / 3, 22 / 3]], dtype=torch.float64))


def zipf_loads(steps: int, experts: int, seed: int, exponent: float = 1.2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    weights = weights[torch.randperm(experts, generator=gen)]
    return torch.poisson(4096 * weights / weights.sum() * torch.ones(steps, experts, dtype=torch.float64),
                         generator=gen)


@pytest.mark.parametrize("experts, ranks, extra", [(256, 8, 32), (384, 16, 64), (64, 8, 0)])
def test_skewed_loads_are_balanced(experts, ranks, extra):
    loads = zipf_loads(20, experts, seed=experts + ranks)
    before = static_placement(experts, extra, ranks).imbalance(loads)
    placement = rebalance(loads, extra, ranks)
    after = placement.imbalance(loads)
    print(f"E={experts} EP={ranks} extra={extra}: max/mean rank load {before:.3f} -> {after:.3f}")
    assert after < before
    if extra:  # without redundant experts the hottest expert alone can outweigh a rank's share
        assert after < 1.2
    slots = (experts + extra) // ranks
    assert placement.physical_to_logical.numel() == experts + extra
    assert torch.equal(torch.bincount(placement.physical_to_logical, minlength=experts), placement.logical_count)
    assert (placement.logical_count >= 1).all()
    hottest = int(loads.sum(dim=0).argmax())
    assert int(placement.logical_count[hottest]) == int(placement.logical_count.max())
    for expert in range(experts):  # the inverse map lists exactly the expert's slots
        listed = placement.logical_to_physical[expert]
        listed = listed[listed >= 0]
        assert sorted(listed.tolist()) == torch.nonzero(placement.physical_to_logical == expert).squeeze(1).tolist()
    assert all(len(placement.physical_to_logical[r * slots:(r + 1) * slots]) == slots for r in range(ranks))


def test_replica_choice_spreads_tokens_over_replicas():
    placement = static_placement(4, 4, 2)  # slots 0..3, then replicas of 0..3 in slots 4..7
    ids = torch.zeros(1000, 1, dtype=torch.int64)
    chosen = replica_of(ids, torch.arange(1000), placement)
    assert set(chosen.flatten().tolist()) == {0, 4}
    assert abs(int((chosen == 0).sum()) - 500) < 60


def test_load_window_keeps_the_last_steps_in_order():
    window = LoadWindow(experts=3, window=2)
    for step in range(3):
        window.record(torch.tensor([step, 10 * step, 0]))
    assert window.loads().tolist() == [[1, 10, 0], [2, 20, 0]]


def test_refusals():
    with pytest.raises(ValueError, match="cannot hold"):
        allocate_replicas(torch.ones(1, 8), 4)
    with pytest.raises(ValueError, match="do not split evenly"):
        rebalance(torch.ones(1, 8), 1, 2)
