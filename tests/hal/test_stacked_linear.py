import math

import pytest
import torch

from deepinfer.hal.formats import quantize
from deepinfer.hal.ops.stacked_linear import stacked_linear
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle
from tests.hal.test_grouped_gemm import float64_values


def stacked_linear_float64(x, weights, positions=None, cos_sin=None, rope_heads=None, norm_weight=None,
                           norm_eps=1e-6, keep_normed=False, norm_dtype=None, swiglu=False, swiglu_limit=None,
                           out_dtype=None):
    """Each product element by element in float64 from the operands' decoded values; with
    ``norm_weight``, of the rows divided by their root mean square (plus ``norm_eps``) times the
    weight; with ``rope_heads``, each named product's heads turned by hand (:func:`turn_heads_float64`)."""
    xv = float64_values(x).reshape(-1, x.shape[-1])
    if norm_weight is not None:
        xv = torch.stack([row / (sum(float(v) ** 2 for v in row) / len(row) + norm_eps) ** 0.5 for row in xv])
        xv = xv * norm_weight.double()
        if norm_dtype is not None:  # the contract rounds the normalised rows to norm_dtype
            xv = xv.to(norm_dtype).double()
    outs = []
    for weight in weights:
        wv = float64_values(weight)
        out = torch.tensor([[sum(float(a) * float(b) for a, b in zip(row, column)) for column in wv] for row in xv],
                           dtype=torch.float64) if xv.shape[0] * wv.shape[0] <= 4096 else xv @ wv.T
        outs.append(out.reshape(*x.shape[:-1], wv.shape[0]))
    if rope_heads is not None:
        outs = [turn_heads_float64(out, positions, cos_sin, head) if head else out
                for out, head in zip(outs, rope_heads)]
    if swiglu:  # gate * sigmoid(gate) * up, the gate clamped from above and up on both sides
        gate, up = outs[-2], outs[-1]
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        outs = outs[:-2] + [gate / (1 + torch.exp(-gate)) * up]
    return tuple(outs) + ((xv.reshape(x.shape),) if keep_normed else ())


def turn_heads_float64(out, positions, cos_sin, head):
    """Pair ``(2i, 2i + 1)`` of each ``head``-wide head's trailing ``R`` columns of row ``t``
    turned by the angle whose cos and sin are ``cos_sin[positions[t], i]`` and ``[.., R/2 + i]``."""
    out, half = out.clone(), cos_sin.shape[1] // 2
    for t, p in enumerate(positions.tolist()):
        for first in range(head - 2 * half, out.shape[1], head):
            for i in range(half):
                c, s = float(cos_sin[p, i]), float(cos_sin[p, half + i])
                a, b = float(out[t, first + 2 * i]), float(out[t, first + 2 * i + 1])
                out[t, first + 2 * i], out[t, first + 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("case", [c.name for c in SPECS["stacked_linear"].cases
                                  if c.size != "real" and "mxfp4" not in c.name])
def test_stacked_linear_matches_float64(case):
    check_against_oracle("stacked_linear", case, stacked_linear_float64)


def test_two_weights_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    first, second = stacked_linear(x, [torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 2.0], [-1.0, 0.5]])])
    assert first.tolist() == [[3.0], [2.0]]
    assert second.tolist() == [[4.0, 0.0], [-2.0, -3.5]]


def test_each_product_has_linears_dtype():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    plain, quantized = stacked_linear(x, [torch.randn(16, 64, generator=gen).bfloat16(),
                                          quantize(torch.randn(8, 64, generator=gen) / 8, "fp8", 32)])
    assert (plain.dtype, quantized.dtype) == (torch.bfloat16, torch.float32)
    assert plain.is_contiguous() and quantized.shape == (3, 8)


@pytest.mark.parametrize("weights, message", [
    ([], "non-empty sequence"),
    (torch.zeros(4, 8), "non-empty sequence"),
    ([torch.zeros(4, 8), torch.zeros(4, 6)], r"weights\[1\] \(4, 6\)"),
    ([torch.zeros(2, 4, 8)], r"weights\[0\] \(2, 4, 8\)"),
])
def test_bad_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        stacked_linear(torch.zeros(3, 8), weights)


def test_rope_heads_turn_only_the_named_products_tails_by_hand():
    """Two 4-wide heads with R=2: column pairs (2, 3) and (6, 7) turn by the row's angle, the
    rest and the product with head width 0 stay as plain linears."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    w = torch.arange(16.0).view(8, 2)
    cos_sin = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # position 0: no turn; position 1: a quarter turn
    turned, plain = stacked_linear(x, [w, w], torch.tensor([0, 1]), cos_sin, [4, 0])
    assert plain.tolist() == [[0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0], [1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]]
    assert turned[0].tolist() == plain[0].tolist()
    # (a, b) -> (a cos - b sin, a sin + b cos) = (-b, a) at a quarter turn
    assert turned[1].tolist() == [1.0, 3.0, -7.0, 5.0, 9.0, 11.0, -15.0, 13.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(rope_heads=[4]), "needs positions"),
    (dict(positions=torch.zeros(3, dtype=torch.long), cos_sin=torch.zeros(8, 2)), "go with rope_heads"),
    (dict(positions=torch.zeros(3, dtype=torch.long), cos_sin=torch.zeros(8, 2), rope_heads=[4, 4]),
     "one head width per weight"),
    (dict(positions=torch.zeros(3, dtype=torch.long), cos_sin=torch.zeros(8, 2), rope_heads=[5]), "divides"),
    (dict(positions=torch.zeros(3, dtype=torch.long), cos_sin=torch.zeros(8, 4), rope_heads=[2]), "at least"),
    (dict(positions=torch.zeros(2, dtype=torch.long), cos_sin=torch.zeros(8, 2), rope_heads=[4]), "positions"),
])
def test_bad_rope_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stacked_linear(torch.zeros(3, 8), [torch.zeros(12, 8)], **kwargs)


def test_norm_weight_normalises_the_input_by_hand():
    """Rows (3, 4) and (0, 2), root mean squares 3.5355 and 1.4142: each weight reads the
    normalised row times the norm weight (2, 0.5)."""
    x = torch.tensor([[3.0, 4.0], [0.0, 2.0]], dtype=torch.float64)
    (y,) = stacked_linear(x, [torch.eye(2, dtype=torch.float64)], norm_weight=torch.tensor([2.0, 0.5],
                                                                                           dtype=torch.float64),
                          norm_eps=0.0)
    rms = torch.tensor([[12.5 ** 0.5], [2.0 ** 0.5]], dtype=torch.float64)
    assert torch.allclose(y, x / rms * torch.tensor([2.0, 0.5], dtype=torch.float64), rtol=1e-6)
    (y_again, normed) = stacked_linear(x, [torch.eye(2, dtype=torch.float64)], norm_weight=torch.tensor(
        [2.0, 0.5], dtype=torch.float64), norm_eps=0.0, keep_normed=True)
    assert torch.equal(normed, y_again)  # the identity weight: the product is the normalised input
    with pytest.raises(ValueError, match="keep_normed and norm_dtype are about the normalised input"):
        stacked_linear(x, [torch.eye(2, dtype=torch.float64)], keep_normed=True)
    with pytest.raises(ValueError, match="norm_weight must be"):
        stacked_linear(x, [torch.eye(2, dtype=torch.float64)], norm_weight=torch.ones(3, dtype=torch.float64))


def test_swiglu_replaces_the_last_two_products_by_hand():
    """x = (1, 2); gate weight rows give 3 and -2, up rows 1 and 4: silu(3) * 1 and silu(-2) * 4,
    and with limit 2: silu(2) * 1 and silu(-2) * 2."""
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    first = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    gate = torch.tensor([[1.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    up = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    plain, act = stacked_linear(x, [first, gate, up], swiglu=True)
    assert plain.tolist() == [[1.0]]
    assert torch.allclose(act, torch.tensor([[silu(3.0) * 1.0, silu(-2.0) * 4.0]], dtype=torch.float64))
    (clamped,) = stacked_linear(x, [gate, up], swiglu=True, swiglu_limit=2.0)
    assert torch.allclose(clamped, torch.tensor([[silu(2.0) * 1.0, silu(-2.0) * 2.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="swiglu takes the last two weights"):
        stacked_linear(x, [gate, first], swiglu=True)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_mxfp4_products_leave_on_the_e2m1_grid_of_their_blocks():
    """The named products are the plain ones cast through MXFP4: per block of 32 along the width a
    power-of-two scale, the least that brings the block's largest magnitude within 6, and every
    value a signed e2m1 magnitude times it, the nearest one to the plain value; the others are
    left as they are."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    weights = [torch.randn(n, 48, generator=gen).to(torch.bfloat16) for n in (32, 64)]
    plain = stacked_linear(x, weights)
    kept, cast = stacked_linear(x, weights, mxfp4_products=(1,))
    assert torch.equal(kept, plain[0]) and cast.dtype == torch.bfloat16
    for row, plain_row in zip(cast.double(), plain[1].double()):
        for block, plain_block in zip(row.split(32), plain_row.split(32)):
            scale = 2.0 ** math.ceil(math.log2(plain_block.abs().max().item() / 6))
            for value, want in zip((block / scale).tolist(), (plain_block / scale).tolist()):
                assert abs(value) in E2M1
                assert abs(abs(value) - abs(want)) <= min(abs(abs(want) - g) for g in E2M1) + 1e-12


def test_mxfp4_products_by_hand():
    """One block of 32: the largest magnitude 12 needs the scale 2 (12 / 2 = 6); 1.3 / 2 = 0.65 goes
    to e2m1's 0.5, -5 / 2 = -2.5 to -2 (the tie to the even code), 0.2 / 2 to 0."""
    x = torch.ones(1, 1, dtype=torch.float64)
    values = torch.zeros(32, 1, dtype=torch.float64)
    values[:4, 0] = torch.tensor([12.0, 1.3, -5.0, 0.2])
    (cast,) = stacked_linear(x, [values], mxfp4_products=(0,))
    assert cast[0, :4].tolist() == [12.0, 1.0, -4.0, 0.0] and not cast[0, 4:].any()


@pytest.mark.parametrize("mxfp4", [(2,), (0, 0), (1,)])
def test_bad_mxfp4_products_are_refused(mxfp4):
    x = torch.ones(1, 8)
    with pytest.raises(ValueError, match="mxfp4_products"):
        stacked_linear(x, [torch.ones(32, 8), torch.ones(16, 8)], mxfp4_products=mxfp4)
