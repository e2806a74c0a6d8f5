"""Candidate blocks (two-stage indexer top-k), worked by hand: block maxima over each row's
window, the window's last block always kept, ties to the lower block."""
import pytest
import torch

from deepinfer.hal.ops.candidate_blocks import candidate_blocks
from deepinfer.hal.spec import SPECS


def _mask(logits, start, length, block_size, blocks):
    got = candidate_blocks(torch.tensor([logits], dtype=torch.float32), torch.tensor([start]), torch.tensor([length]), block_size, blocks)
    return [int(v) for v in got[0]]


def test_the_best_block_and_the_last_block_are_kept():
    """Window = columns 1..9: blocks [0 5 1] [2 7 3] [0 0 0] score 5, 7 and +inf (the last)."""
    assert _mask([9, 0, 5, 1, 2, 7, 3, 0, 0, 0], 1, 9, 3, 2) == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]


def test_a_partial_last_block_is_kept_and_ties_go_to_the_lower_block():
    """Window = columns 0..6, blocks of 3: [4 1 4] [0 4 2] [0]: scores 4, 4, +inf; keep 2 -> blocks 0 and 2."""
    assert _mask([4, 1, 4, 0, 4, 2, 0, 8], 0, 7, 3, 2) == [1, 1, 1, 0, 0, 0, 1, 0]


def test_a_window_of_at_most_blocks_blocks_keeps_everything_in_it():
    assert _mask([1, 2, 3, 4, 5, 6], 2, 3, 2, 2) == [0, 0, 1, 1, 1, 0]
    assert _mask([1, 2, 3], 0, 0, 2, 1) == [0, 0, 0]


@pytest.mark.parametrize("case", [c.name for c in SPECS["candidate_blocks"].cases if c.size == "tiny"])
def test_every_kept_column_is_in_one_of_the_best_blocks(case):
    """Against a plain loop: per row, block maxima (last block +inf), ranked with ties to the lower block."""
    inputs = SPECS["candidate_blocks"].case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    got = candidate_blocks(**inputs)
    size, keep = inputs["block_size"], inputs["blocks"]
    for t, (start, length) in enumerate(zip(inputs["starts"].tolist(), inputs["lengths"].tolist())):
        window = inputs["logits"][t, start:start + length].tolist()
        scores = [max(window[b:b + size]) for b in range(0, length, size)]
        if scores:
            scores[-1] = float("inf")
        best = sorted(range(len(scores)), key=lambda b: (-scores[b], b))[:keep]
        want = [0] * inputs["logits"].shape[1]
        for b in best:
            for o in range(b * size, min(b * size + size, length)):
                want[start + o] = 1
        assert got[t].int().tolist() == want, (case, t)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size and blocks must be ints >= 1"):
        candidate_blocks(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0, 1)
