import numpy as np
import pytest
import torch

from deepinfer.hal.ops import token_bitmask
from deepinfer.hal.ops.token_bitmask import apply_token_bitmask, random_bitmask
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def bitmask_float64(logits, bitmask, rows=None):
    """Token by token from the layout: bit t % 32 of word t // 32, as unsigned 32-bit words."""
    out = logits.clone()
    words = bitmask.numpy().astype(np.int64) & 0xFFFFFFFF
    targets = range(logits.shape[0]) if rows is None else rows.tolist()
    for mask, row in zip(words, targets):
        for token in range(logits.shape[1]):
            if not (int(mask[token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.fixture(params=["compiled", "eager"])
def path(request, monkeypatch):
    """On the CPU the op runs a torch.compile kernel; the eager path serves where that fails."""
    if request.param == "eager":
        monkeypatch.setattr(token_bitmask, "_COMPILE_FAILED", True)
    return request.param


@pytest.mark.parametrize("case", [c.name for c in SPECS["apply_token_bitmask"].cases if c.size == "tiny"])
def test_apply_token_bitmask_matches_the_bit_layout(case, path):
    check_against_oracle("apply_token_bitmask", case, bitmask_float64)


def test_real_size_masks_match_an_unpacked_oracle(path):
    """16 x 129280 (V4 vocab): the same bits unpacked by shifts in int64, no numpy bit tricks."""
    gen = torch.Generator().manual_seed(1)
    logits, bitmask = torch.randn(16, 129280, generator=gen), random_bitmask(16, 129280, 0.5, gen)
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    allowed = ((words[..., None] >> torch.arange(32)) & 1).bool().flatten(1)[:, :129280]
    want = torch.where(allowed, logits, float("-inf"))
    got = apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(got, want)


def test_the_big_endian_path_matches_the_byte_table_path(monkeypatch):
    """Big-endian hosts shift bits out of whole words instead of reading bytes (eagerly)."""
    monkeypatch.setattr(token_bitmask, "_COMPILE_FAILED", True)
    gen = torch.Generator().manual_seed(3)
    logits, bitmask = torch.randn(7, 1000, generator=gen), random_bitmask(7, 1000, 0.3, gen)
    want = apply_token_bitmask(logits.clone(), bitmask)
    monkeypatch.setattr(token_bitmask.sys, "byteorder", "big")
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), want)


def test_masking_is_in_place_leaves_allowed_logits_bit_identical_and_other_rows_alone(path):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 70, generator=gen)
    original = logits.clone()
    bitmask = random_bitmask(2, 70, 0.5, gen)
    out = apply_token_bitmask(logits, bitmask, torch.tensor([4, 1]))
    assert out is logits
    assert torch.equal(logits[[0, 2, 3, 5]], original[[0, 2, 3, 5]])
    kept = torch.isfinite(logits)
    assert torch.equal(logits[kept], original[kept])
    assert kept[[1, 4]].sum() > 0 and (~kept[[1, 4]]).sum() > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"logits": torch.zeros(2, 64, dtype=torch.float64)}, r"float32 logits \[N, V\]"),
    ({"bitmask": torch.zeros(2, 3, dtype=torch.int32)}, r"int32 \[M, 2\] \(ceil\(V / 32\) words for V=64\)"),
    ({"bitmask": torch.zeros(1, 2, dtype=torch.int32)}, r"one row per logits row \(2\)"),
    ({"rows": torch.tensor([1, 1])}, r"distinct logits rows in \[0, 2\)"),
    ({"rows": torch.tensor([2, 0])}, r"distinct logits rows in \[0, 2\)"),
    ({"rows": torch.tensor([0])}, r"rows must be int64 \[2\]"),
])
def test_bad_arguments_say_what_is_expected(kwargs, match):
    args = {"logits": torch.zeros(2, 64), "bitmask": torch.zeros(2, 2, dtype=torch.int32), **kwargs}
    with pytest.raises(ValueError, match=match):
        apply_token_bitmask(**args)
