import math

import pytest
import torch

from deepinfer.hal.ops.rope import YarnScaling, apply_rope, rope_cos_sin, rope_inv_freq
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def apply_rope_float64(x, positions, cos_sin, conjugate=False):
    """Token by token: view each trailing pair as a complex number and multiply by e^(+-i angle)."""
    rope_dim = cos_sin.shape[1]
    out = x.clone()
    for t in range(x.shape[0]):
        row = cos_sin[positions[t]]
        cos, sin = row[: rope_dim // 2], row[rope_dim // 2:]
        turn = torch.complex(cos, -sin if conjugate else sin)
        pairs = torch.view_as_complex(x[t, ..., -rope_dim:].reshape(*x.shape[1:-1], rope_dim // 2, 2).contiguous())
        out[t, ..., -rope_dim:] = torch.view_as_real(pairs * turn).flatten(-2)
    return out


def inv_freq_float64(theta, rope_dim, yarn=None):
    """Pair by pair from the YaRN definition, in Python floats."""
    freqs = [theta ** (-2 * i / rope_dim) for i in range(rope_dim // 2)]
    if yarn is None:
        return freqs

    def pair_for(rotations):
        wavelength_count = yarn.original_max_position_embeddings / (2 * math.pi * rotations)
        return rope_dim / 2 * math.log(wavelength_count) / math.log(theta)

    low = max(math.floor(pair_for(yarn.beta_fast)), 0)
    high = min(math.ceil(pair_for(yarn.beta_slow)), rope_dim - 1)
    blended = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        blended.append(ramp * f / yarn.factor + (1 - ramp) * f)
    return blended


@pytest.mark.parametrize("case", [c.name for c in SPECS["apply_rope"].cases])
def test_apply_rope_matches_float64(case):
    check_against_oracle("apply_rope", case, apply_rope_float64)


def test_two_pairs_by_hand():
    # pair 0 turns by pi/2 and pair 1 by pi at position 1; the first two dims are not rotated
    cos_sin = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, -1.0, 1.0, 0.0]])
    x = torch.tensor([[7.0, 8.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_rope(x, torch.tensor([1]), cos_sin)
    assert out.tolist() == [[7.0, 8.0, -2.0, 1.0, -3.0, -4.0]]
    assert apply_rope(out, torch.tensor([1]), cos_sin, conjugate=True).tolist() == x.tolist()


def test_conjugate_undoes_rotation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, 192, generator=gen)
    positions = torch.randint(0, 1000, (6,), generator=gen)
    table = rope_cos_sin(rope_inv_freq(10000.0), 1000)
    rotated = apply_rope(x, positions, table)
    assert not torch.allclose(rotated[..., -64:], x[..., -64:])
    assert torch.allclose(apply_rope(rotated, positions, table, conjugate=True), x, atol=1e-5, rtol=1e-5)


def test_rotation_keeps_bf16_dtype_and_leading_dims_bitwise():
    x = torch.randn(3, 2, 100).bfloat16()
    out = apply_rope(x, torch.tensor([0, 5, 9]), rope_cos_sin(rope_inv_freq(10000.0), 10))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[..., :36], x[..., :36])


@pytest.mark.parametrize("yarn", [None, YarnScaling(16.0, 65536, 32.0, 1.0), YarnScaling(4.0, 4096, 32.0, 1.0),
                                  YarnScaling(40.0, 4096, 1000.0, 0.001)])
def test_inv_freq_is_the_float64_formula_rounded_in_float32(yarn):
    got = rope_inv_freq(160000.0, 64, yarn)
    assert got.dtype == torch.float32 and got.shape == (32,)
    assert torch.allclose(got.double(), torch.tensor(inv_freq_float64(160000.0, 64, yarn), dtype=torch.float64),
                          atol=0.0, rtol=4e-7)


def test_far_positions_keep_the_float32_rounding_of_their_angle():
    """DeepInfer's tables (the official checkpoint's) form ``position * frequency`` in
    float32. By hand: float32(0.1) * 1000048 rounds to 100004.8046875 in float32, 3.2e-3 past the
    exact product 100004.80149..., and cos follows the rounded angle."""
    table = rope_cos_sin(torch.tensor([0.1]), 1000049)
    assert table[1000048, 0].item() == pytest.approx(math.cos(100004.8046875), abs=1e-6)
    assert abs(table[1000048, 0].item() - math.cos(1000048 * 0.10000000149011612)) > 3e-3


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    base = rope_inv_freq(160000.0)
    scaled = rope_inv_freq(160000.0, yarn=YarnScaling(16.0, 65536, 32.0, 1.0))
    assert torch.equal(scaled[:10], base[:10])
    assert torch.allclose(scaled[-4:], base[-4:] / 16, atol=0.0, rtol=1e-12)


def test_cos_sin_table_layout():
    inv_freq = torch.tensor([1.0, 0.5], dtype=torch.float64)
    table = rope_cos_sin(inv_freq, 3)
    want = [[math.cos(p * f) for f in (1.0, 0.5)] + [math.sin(p * f) for f in (1.0, 0.5)] for p in range(3)]
    assert table.dtype == torch.float32 and table.shape == (3, 4)
    assert torch.allclose(table, torch.tensor(want), atol=1e-7, rtol=0)


@pytest.mark.parametrize("positions, match", [(torch.tensor([0, 10]), "positions must lie in"),
                                              (torch.tensor([-1, 0]), "positions must lie in"),
                                              (torch.tensor([0]), "positions must be int64"),
                                              (torch.tensor([0.0, 1.0]), "positions must be int64")])
def test_bad_positions_are_rejected(positions, match):
    with pytest.raises(ValueError, match=match):
        apply_rope(torch.zeros(2, 64), positions, rope_cos_sin(rope_inv_freq(10000.0), 10))


def test_too_narrow_x_is_rejected():
    with pytest.raises(ValueError, match="D >= rope_dim=64"):
        apply_rope(torch.zeros(2, 32), torch.tensor([0, 1]), rope_cos_sin(rope_inv_freq(10000.0), 10))


@pytest.mark.parametrize("conjugate", [False, True])
def test_out_writes_the_tail_of_each_head_in_place(conjugate):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 3, 160, generator=gen)
    positions = torch.randint(0, 50, (5,), generator=gen)
    table = rope_cos_sin(rope_inv_freq(10000.0), 50)
    expected = apply_rope_float64(q.double(), positions, table.double(), conjugate)
    tail = q[..., 96:]
    returned = apply_rope(tail, positions, table, conjugate=conjugate, out=tail)
    assert returned.data_ptr() == tail.data_ptr()
    assert torch.allclose(q.double(), expected, atol=1e-5, rtol=1e-5)


def test_out_of_another_shape_is_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="out must match x"):
        apply_rope(x, torch.tensor([0, 1]), rope_cos_sin(rope_inv_freq(10000.0), 4), out=torch.empty(2, 32))
