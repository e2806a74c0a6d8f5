"""The bytes DeepInfer 0.1.0 writes for the quantized caches, activations and weights (issue 29),
worked out by hand from its rules:

* a block's max is floored before its scale is taken: ``fp8`` at 1e-4, ``index_fp4`` (MXFP4) at
  ``6 * 2^-126``, ``fp4`` (e4m3 scales) at ``6 * 2^-9``;
* a UE8M0 scale is the least power of two at or above ``max / fmt_max``, read from the float32
  quotient's bits;
* the ``fp4`` scale is ``e4m3(max * float32(1/6))`` and values are multiplied by the float32
  reciprocal of that scale (a tie under exact division may round up after it);
* an e2m1 code keeps the sign bit of a value that rounds to zero (nibble 0x8)."""
import torch

from deepinfer.hal.formats import cast_back, decode_tokens, encode_tokens, quantize, quantize_weight_fp8

NEXT_AFTER_448 = 448.0 + 2.0 ** -15
"""The float32 just above 448: ``max / 448`` rounds to ``1 + 2^-23``, so the scale is 2, not 1."""


def _row(dim: int, values: dict[int, list[float]]) -> torch.Tensor:
    """One float32 row of ``dim`` zeros with ``values`` written from each start index."""
    row = torch.zeros(1, dim)
    for start, chunk in values.items():
        row[0, start:start + len(chunk)] = torch.tensor(chunk)
    return row


def test_fp8_zero_and_tiny_blocks_take_the_floor_scale():
    """Blocks of 32. Zero: max floored to 1e-4, 1e-4 / 448 ~ 2^-22.1, scale 2^-22 (byte 105).
    Max 2^-15 (below the floor): the same scale; 2^-15 * 2^22 = 128 = e4m3 0x70, -2^-16 -> -64 =
    0xE8. Max 1e-4: 1e-4 * 2^22 ~ 419.4 -> 416 = 0x7D."""
    row = encode_tokens(_row(512, {32: [2.0 ** -15, -(2.0 ** -16)], 64: [1e-4]}), "fp8")[0]
    assert row[512:515].tolist() == [105, 105, 105]
    assert row[:32].tolist() == [0] * 32
    assert row[32:34].tolist() == [0x70, 0xE8] and row[64].item() == 0x7D
    assert decode_tokens(row[None], "fp8")[0, 32].item() == 2.0 ** -15


def test_fp8_scale_steps_up_one_ulp_above_a_power_of_two():
    """Max 448: scale 1 (byte 127). Max the float32 after 448: scale 2 (byte 128) and 448.00003 / 2
    = 224.00002 -> e4m3 224 = 0x76."""
    row = encode_tokens(_row(512, {0: [448.0], 32: [NEXT_AFTER_448]}), "fp8")[0]
    assert row[512:514].tolist() == [127, 128]
    assert row[0].item() == 0x7E and row[32].item() == 0x76


def test_fp8_activations_follow_the_same_rule():
    """``quantize('fp8')`` (the grouped GEMMs' activations): a zero block gets byte 105 and a block of
    max 2^-15 the bytes 0x70 under byte 105."""
    q = quantize(torch.cat((torch.zeros(1, 32), torch.full((1, 32), 2.0 ** -15)), dim=1), "fp8")
    assert q.scale.tolist() == [[105, 105]]
    assert q.data.view(torch.uint8)[0].tolist() == [0] * 32 + [0x70] * 32


def test_checkpoint_fp8_weight_tiles_follow_the_same_rule():
    """The checkpoint writer's 32x32 tiles: a zero tile gets byte 105, a tile of max 2^-15 the
    e4m3 0x70 under byte 105, a tile of max 896 byte 128 (896 / 2 = 448 = 0x7E)."""
    weight = torch.zeros(32, 96)
    weight[0, 32] = 2.0 ** -15
    weight[5, 64] = 896.0
    data, scale = quantize_weight_fp8(weight)
    assert scale.tolist() == [[105, 105, 128]]
    assert data.view(torch.uint8)[0, 32].item() == 0x70 and data.view(torch.uint8)[5, 64].item() == 0x7E
    assert not data.view(torch.uint8)[:, :32].any()


def test_fp4_reciprocal_multiply_rounds_halfway_values_up():
    """Block max 5.625: 5.625 * float32(1/6) = 0.9375, e4m3 byte 0x37; its float32 reciprocal is
    1.0666667 (above 16/15). 1.171875, 2.34375 and 4.6875 are 1.25, 2.5 and 5 scales exactly, ties
    that round to even (codes 2, 4, 6) after an exact division; times the reciprocal they lie just
    above and round up to codes 3, 5, 7. 5.625 -> 6.0000005, saturating at code 7."""
    row = encode_tokens(_row(512, {0: [5.625, 1.171875, 2.34375, 4.6875]}), "fp4")[0]
    assert row[256].item() == 0x37
    assert row[:2].tolist() == [0x37, 0x75]


def test_fp4_negative_values_rounding_to_zero_keep_the_sign_bit():
    """Block max 6: scale 1.0 (e4m3 0x38). -0.1 -> nibble 0x8, -0.0 -> 0x8, 0.1 -> 0x0, -0.25 (a
    tie to 0) -> 0x8, -0.5 -> 0x9; the even index in the low nibble. Decoded, the zeros keep their
    sign."""
    row = encode_tokens(_row(512, {0: [6.0, -0.1, -0.0, 0.1, -0.25, -0.5]}), "fp4")[0]
    assert row[256].item() == 0x38
    assert row[:3].tolist() == [0x87, 0x08, 0x98]
    decoded = decode_tokens(row[None], "fp4")[0, :6]
    assert torch.signbit(decoded).tolist() == [False, True, True, False, True, True]


def test_fp4_tiny_and_zero_blocks_take_the_smallest_e4m3_scale():
    """Block max 0.001 (below 6 * 2^-9): floored to 6 * 2^-9, scale 2^-9 (e4m3 byte 0x01), the
    reciprocal 512. 0.001 -> 0.512 -> code 1; -0.0005 -> -0.256 -> 0x9; 0.0004 -> 0.2048 -> 0x0;
    -0.0004 -> 0x8. A zero block also gets byte 0x01."""
    row = encode_tokens(_row(512, {0: [0.001, -0.0005, 0.0004, -0.0004]}), "fp4")[0]
    assert row[256:].tolist() == [0x01] * 32
    assert row[:2].tolist() == [0x91, 0x80] and not row[2:256].any()


def test_index_fp4_zero_block_gets_scale_byte_1():
    """MXFP4 per 32: a zero block's max floored to 6 * 2^-126 gives scale 2^-126 (byte 1); a block
    of max 2^-127 (a float32 subnormal) the same scale, and 2^-127 * 2^126 = 0.5 -> code 1."""
    row = encode_tokens(_row(128, {32: [2.0 ** -127]}), "index_fp4")[0]
    assert row[64:].tolist() == [1, 1, 1, 1]
    assert row[16].item() == 0x01 and not row[:16].any() and not row[17:64].any()


def test_index_fp4_negative_values_rounding_to_zero_keep_the_sign_bit():
    """Block max 6: scale 1 (byte 127); 6 -> 7, -0.1 -> 0x8, -0.0 -> 0x8, -1 -> 0xA. The MXFP4 cast
    back (the index queries' path) keeps the sign of those zeros too."""
    x = _row(128, {0: [6.0, -0.1, -0.0, -1.0]})
    row = encode_tokens(x, "index_fp4")[0]
    assert row[64].item() == 127 and row[:2].tolist() == [0x87, 0xA8]
    assert torch.signbit(cast_back(x, "mxfp4", 32)[0, :4]).tolist() == [False, True, True, True]
