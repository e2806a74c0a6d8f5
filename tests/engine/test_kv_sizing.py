"""KV cache sizing: what a model's caches take, and how many blocks fit a device's memory
(a device stand-in reports the memory and the profiled step's peak)."""
import dataclasses
import math

import pytest
import torch

from deepinfer.config.compose import compose
from deepinfer.engine.device import Runtime
from deepinfer.engine.kv_sizing import GIB, RESERVE, plan_kv_blocks
from deepinfer.hal.registry import OpTable
from deepinfer.models.registry import build_model


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value):
        return sum(_tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@pytest.fixture(scope="module")
def model():
    app = compose(["model=tiny_random"])
    return build_model(app.model, OpTable("reference"), torch.device("cpu"), 0)[0]


@pytest.mark.parametrize("blocks, slots", [(1, 0), (0, 1), (7, 3)])
def test_cache_bytes_are_what_allocation_takes(model, blocks, slots):
    assert model.cache_bytes(blocks, slots) == _tensor_bytes(model.allocate_caches(blocks, slots)) - \
        _tensor_bytes(model.allocate_caches(0, 0))


class ReportingDevice(Runtime):
    """The CPU, reporting ``free`` of ``total`` bytes and a profiled step whose allocations
    peak at ``peak`` bytes (nothing else counted as allocated)."""

    def __init__(self, free: int, total: int, peak: int):
        super().__init__(torch.device("cpu"))
        self.free, self.total, self.peak = free, total, peak

    def memory(self):
        return self.free, self.total

    def peak_allocated(self):
        return self.peak


def _engine(**overrides):
    return compose(["model=tiny_random"] + [f"engine.{k}={v}" for k, v in overrides.items()]).engine


def test_blocks_fill_the_share_left_by_weights_and_activations(model):
    total, weights, peak = 80 * GIB, 3 * GIB, 2 * GIB
    device = ReportingDevice(free=total - weights, total=total, peak=peak)
    engine = _engine(gpu_memory_utilization=0.5)
    blocks = plan_kv_blocks(model, OpTable("reference"), device, engine, 0, graphs=True, weight_bytes=weights)
    room = 0.5 * total - weights - 2 * peak - model.cache_bytes(0, engine.max_num_seqs + 1)
    assert blocks == int(room // model.cache_bytes(1, 0))


def test_blocks_never_take_more_than_is_free(model):
    total, peak = 80 * GIB, GIB
    device = ReportingDevice(free=10 * GIB, total=total, peak=peak)
    engine = _engine(gpu_memory_utilization=0.9)
    blocks = plan_kv_blocks(model, OpTable("reference"), device, engine, 0, graphs=False, weight_bytes=GIB)
    room = 10 * GIB - peak - RESERVE - model.cache_bytes(0, engine.max_num_seqs + 1)
    assert blocks == int(room // model.cache_bytes(1, 0))


def test_a_device_too_small_for_one_sequence_is_refused_clearly(model):
    per_seq = math.ceil(model.max_model_len / model.page_tokens) + 1
    need = per_seq * model.cache_bytes(1, 0) + model.cache_bytes(0, 33)
    device = ReportingDevice(free=need // 2 + RESERVE, total=need * 4, peak=0)
    with pytest.raises(ValueError, match=r"one sequence of max_model_len \d+ needs .*raise engine.gpu_memory_utilization"):
        plan_kv_blocks(model, OpTable("reference"), device, _engine(), 0, graphs=False, weight_bytes=0)


def test_num_kv_blocks_overrides_the_profile_and_is_checked(model):
    device = ReportingDevice(free=GIB, total=GIB, peak=0)
    assert plan_kv_blocks(model, OpTable("reference"), device, _engine(num_kv_blocks=40), 0, False, 0) == 40
    with pytest.raises(ValueError, match="engine.num_kv_blocks=2 cannot hold one sequence"):
        plan_kv_blocks(model, OpTable("reference"), device, _engine(num_kv_blocks=2), 0, False, 0)
