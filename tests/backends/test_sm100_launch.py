"""sm100's launch helpers on CPU tensors: converted copies of parameters (``launch.param_copy``,
``launch.float32_param``) and shared tile schedules (``gemm.shared_schedule``)."""
import torch
from torch import nn

from deepinfer_backends.sm100 import launch


def test_a_bf16_weight_is_converted_once_and_again_after_it_changes():
    weight = nn.Parameter(torch.tensor([1.5, -2.25, 3.0]).bfloat16(), requires_grad=False)
    first = launch.float32_param(weight)
    assert first.dtype == torch.float32 and first.tolist() == [1.5, -2.25, 3.0]
    assert launch.float32_param(weight) is first
    with torch.no_grad():
        weight.copy_(torch.tensor([4.0, 5.0, 6.0]))  # in place: the version counter moves
    second = launch.float32_param(weight)
    assert second is not first and second.tolist() == [4.0, 5.0, 6.0]
    weight.data = torch.tensor([7.0, 8.0, 9.0]).bfloat16()  # new data: another address
    assert launch.float32_param(weight).tolist() == [7.0, 8.0, 9.0]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def test_float32_weights_pass_through_and_other_tensors_are_converted_every_call():
    plain = torch.randn(4)
    assert launch.float32_param(plain) is plain
    a, b = _param(torch.ones(4).bfloat16()), _param(torch.full((4,), 2.0).bfloat16())
    assert launch.float32_param(a).tolist() == [1.0] * 4 and launch.float32_param(b).tolist() == [2.0] * 4
    strided = torch.arange(8.0)[::2]
    assert launch.float32_param(strided).is_contiguous() and launch.float32_param(strided).tolist() == [0, 2, 4, 6]
    temporary = torch.ones(3).bfloat16()
    assert launch.float32_param(temporary) is not launch.float32_param(temporary)
    assert all(entry[0] is not temporary for entry in launch._PARAM_COPIES.values())


def test_the_copies_are_bounded(monkeypatch):
    monkeypatch.setattr(launch, "PARAM_COPIES", 3)
    monkeypatch.setattr(launch, "_PARAM_COPIES", type(launch._PARAM_COPIES)())
    weights = [_param(torch.full((2,), float(i)).bfloat16()) for i in range(5)]
    for w in weights:
        launch.float32_param(w)
    assert len(launch._PARAM_COPIES) == 3
    assert [entry[0] for entry in launch._PARAM_COPIES.values()] == weights[2:]


def test_each_kind_of_copy_is_kept_apart():
    weight = _param(torch.tensor([1.0, 2.0]))
    doubled = launch.param_copy(weight, "doubled", lambda w: w * 2)
    negated = launch.param_copy(weight, "negated", lambda w: -w)
    assert doubled.tolist() == [2.0, 4.0] and negated.tolist() == [-1.0, -2.0]
    assert launch.param_copy(weight, "doubled", lambda w: w * 3) is doubled


def test_calls_sharing_a_schedule_dict_share_one_tile_schedule():
    from deepinfer.hal.ops.grouped_gemm import tile_bounds
    from deepinfer_backends.sm100.gemm import shared_schedule

    sizes = torch.tensor([3, 0, 5])
    schedules = {}
    first = shared_schedule(sizes, 8, 2, torch.device("cpu"), schedules)
    assert first.tolist() == torch.stack(tile_bounds(sizes, 8, 2)).tolist()
    assert shared_schedule(sizes, 8, 2, torch.device("cpu"), schedules) is first
    assert shared_schedule(sizes, 8, 4, torch.device("cpu"), schedules) is not first  # another tile height
    assert shared_schedule(sizes, 8, 2, torch.device("cpu"), None) is not first


def test_calls_on_one_group_sizes_tensor_share_its_schedule_until_it_is_written():
    from deepinfer.hal.ops.grouped_gemm import tile_bounds
    from deepinfer_backends.sm100.gemm import shared_schedule

    sizes = torch.tensor([3, 0, 5])
    first = shared_schedule(sizes, 8, 2, torch.device("cpu"))
    assert shared_schedule(sizes, 8, 2, torch.device("cpu")) is first
    assert shared_schedule(sizes.clone(), 8, 2, torch.device("cpu")) is not first  # another tensor
    assert shared_schedule(sizes, 8, 4, torch.device("cpu")) is not first  # another tile height
    sizes[0], sizes[2] = 5, 3  # written in place: the schedule is made again
    again = shared_schedule(sizes, 8, 2, torch.device("cpu"))
    assert again is not first and again.tolist() == torch.stack(tile_bounds(sizes, 8, 2)).tolist()
    with torch.inference_mode():
        frozen = torch.tensor([2, 6])
        assert shared_schedule(frozen, 8, 2, torch.device("cpu")) is shared_schedule(frozen, 8, 2, torch.device("cpu"))
