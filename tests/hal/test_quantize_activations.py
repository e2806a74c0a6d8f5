"""``quantize_activations``: DeepInfer's per-token FP8 cast, on hand-worked bytes (e4m3 codes,
UE8M0 scales, ties to even, subnormals, the floor, the scale rule's boundary) and its refusals."""
import pytest
import torch

from deepinfer.hal.formats import dequantize
from deepinfer.hal.ops.quantize_activations import quantize_activations


def _codes(q) -> list[int]:
    return q.data.view(torch.uint8).flatten().tolist()


def test_a_block_at_full_scale_rounds_to_nearest_even_codes():
    # max 448 = 1.75 * 2^8: scale 2^0 (byte 127). e4m3 steps are 0.125 in [1, 2) and 2^-9 below 2^-6
    values = [448.0, -448.0, 1.0625, -1.1875, 1.125 * 2 ** -7, 3 * 2 ** -8, 2 ** -10, -3 * 2 ** -10]
    q = quantize_activations(torch.tensor([values + [0.0] * 24]))
    assert q.fmt == "fp8" and q.block == 32 and q.scale.tolist() == [[127]]
    # 448 = 0x7E; 1.0625 ties to 1.0 (0x38); -1.1875 ties to -1.25 (0xBA); 4.5 * 2^-9 ties to 4 * 2^-9 (0x04);
    # 6 * 2^-9 is exact (0x06); 0.5 * 2^-9 ties to zero (0x00); -1.5 * 2^-9 ties to -2 * 2^-9 (0x82)
    assert _codes(q)[:8] == [0x7E, 0xFE, 0x38, 0xBA, 0x04, 0x06, 0x00, 0x82]


def test_each_block_of_32_takes_its_own_power_of_two_scale():
    # maxima 1.75 * 2^3 -> 2^-5 (byte 122); just above it -> 2^-4 (123); 1.0 -> 2^-8 (119)
    above = torch.tensor(1.75 * 8).nextafter(torch.tensor(100.0)).item()
    row = torch.tensor([1.75 * 8] + [1.0] * 31 + [above] + [0.5] * 31 + [1.0] * 32)
    q = quantize_activations(row)
    assert q.scale.tolist() == [122, 123, 119]
    # 14 / 2^-5 = 448 (0x7E), 1 / 2^-5 = 32 (0x60); the other max over 2^-4 rounds to 224 (0x76); 1 / 2^-8 = 256 (0x78)
    assert [_codes(q)[i] for i in (0, 1, 32, 64)] == [0x7E, 0x60, 0x76, 0x78]
    assert dequantize(q)[0].item() == 14.0 and dequantize(q)[33].item() == 0.5


def test_a_zero_block_takes_the_floors_scale_and_keeps_signed_zeros():
    q = quantize_activations(torch.tensor([[0.0, -0.0] * 16 + [2.0 ** -30] * 32]))
    # the floor 1e-4 gives 2^-22 (byte 105); 2^-30 scaled by 2^22 is 2^-8 = 2 * 2^-9 (code 0x02)
    assert q.scale.tolist() == [[105, 105]]
    assert _codes(q)[:2] == [0x00, 0x80] and set(_codes(q)[32:]) == {0x02}


def test_leading_dims_are_kept():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    q = quantize_activations(x)
    assert q.data.shape == (2, 3, 64) and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.shape == (2, 3, 2) and q.scale.dtype == torch.uint8
    relative = (dequantize(q) - x.float()).abs() / x.float().abs().clamp_min(1e-3)
    assert relative.max() <= 2 ** -4  # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value


def test_a_row_scale_multiplies_the_row_before_the_cast():
    # 448 and 3 under the weight 1/3 (float32): 149.33 and exactly 1.0. Max 149.33 gives 2^-1 (byte 126);
    # 298.67 rounds to 288 (e4m3 steps 32 in [256, 512)), 2 is exact: 144 and 1.0 back. Cast first and
    # weighted after, the same row gives 149.33 and 1.0.
    x = torch.zeros(2, 32)
    x[:, 0], x[:, 1] = 448.0, 3.0
    q = quantize_activations(x, row_scale=torch.tensor([1 / 3, 1.0]))
    assert q.scale.tolist() == [[126], [127]]
    assert dequantize(q)[:, :2].tolist() == [[144.0, 1.0], [448.0, 3.0]]
    bf16 = quantize_activations(x.bfloat16(), row_scale=torch.tensor([1 / 3, 1.0]))
    assert torch.equal(bf16.data.view(torch.uint8), q.data.view(torch.uint8))


@pytest.mark.parametrize("row_scale, match", [
    (torch.ones(3), r"row_scale must be a float32 tensor \(2,\).*float32 \(3,\)"),
    (torch.ones(2, dtype=torch.float64), r"float32 tensor \(2,\).*torch.float64"),
    ([1.0, 1.0], "got list"),
])
def test_a_bad_row_scale_is_refused_with_the_reason(row_scale, match):
    with pytest.raises(ValueError, match=match):
        quantize_activations(torch.ones(2, 32), row_scale=row_scale)


@pytest.mark.parametrize("x, fmt, match", [
    (torch.randn(4, 48), "fp8", "multiple of 32"),
    (torch.randn(4, 64), "mxfp4", "casts to"),
    (torch.ones(4, 64, dtype=torch.int32), "fp8", "float tensor"),
    (torch.tensor(1.0), "fp8", "float tensor"),
])
def test_bad_input_is_refused_with_the_reason(x, fmt, match):
    with pytest.raises(ValueError, match=match):
        quantize_activations(x, fmt)
