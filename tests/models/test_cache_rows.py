"""The paged compressed cache's row arithmetic: logical compressed tokens to flat cache rows, in a
prefill step (``LayerCache.compressed_slots``) and a decode step (HAL ``compressed_decode_layout``)."""
import pytest
import torch

from deepinfer.hal.ops.compressed_layout import compressed_decode_layout
from deepinfer.models.deepseek_v41.cache import LayerCache


def _cache(ratio: int) -> LayerCache:
    return LayerCache(ratio, torch.zeros(1, 1, dtype=torch.uint8))


def _t(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_compressed_slots_by_hand():
    cache = _cache(2)  # 64 compressed tokens a block
    tables = torch.tensor([[5, 2], [7, 0]])
    rows = cache.compressed_slots(tables, torch.tensor([0, 0, 1, 1]), torch.tensor([3, 64, 0, -1]))
    assert rows.tolist() == [5 * 64 + 3, 2 * 64 + 0, 7 * 64 + 0, -1]


def test_decode_layout_by_hand():
    # Ratio 2, 2 compressed tokens a block; sequence 0 holds 7 tokens (3 compressed), sequence 1 holds 4 (2).
    tables = torch.tensor([[5, 2], [7, -1]])
    rows, visible, store, key_pos = compressed_decode_layout(tables, _t(7, 4), _t(6, 3), _t(0, 1), 2, 2)
    assert rows.dtype == torch.int32
    assert rows.tolist() == [[10, 11, 4, -1, -1], [14, 15, -1, -1, -1]]
    assert visible.tolist() == [3, 2]
    # Position 6 closes nothing ((6 + 1) % 2 != 0); position 3 closes sequence 1's key 1, the group at 2..3.
    assert store.tolist() == [-1, 15] and key_pos.tolist() == [0, 2]


def test_decode_layout_ratio1_verify_rows():
    # Ratio 1: every token closes its own key; three verify tokens of one sequence.
    tables = torch.tensor([[3, 1]])
    rows, visible, store, key_pos = compressed_decode_layout(tables, _t(6), _t(3, 4, 5), _t(0, 0, 0), 1, 4)
    assert rows.tolist() == [[12, 13, 14, 15, 4, 5, -1, -1, -1]]
    assert visible.tolist() == [4, 5, 6] and store.tolist() == [15, 4, 5] and key_pos.tolist() == [3, 4, 5]


@pytest.mark.parametrize("ratio", [1, 2])
def test_decode_rows_are_what_compressed_slots_give_for_every_index(ratio):
    cache = _cache(ratio)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randint(0, 50, (3, 4), generator=gen)
    per_seq = 4 * cache.tokens_per_block
    counts = torch.tensor([0, per_seq // 3, per_seq])
    got = compressed_decode_layout(tables, counts * ratio, counts * ratio - 1, _t(0, 1, 2), ratio,
                                   cache.tokens_per_block)[0]
    index = torch.arange(per_seq).expand(3, per_seq)
    want = cache.compressed_slots(tables, torch.arange(3)[:, None].expand(3, per_seq),
                                  index.masked_fill(index >= counts[:, None], -1))
    assert got.shape == (3, per_seq + 1) and torch.equal(got[:, :-1].long(), want) and (got[:, -1] == -1).all()
    assert (got[0] == -1).all() and (got[2, :-1] >= 0).all()


def test_a_counted_token_in_a_missing_block_is_refused():
    with pytest.raises(ValueError, match="block the block table does not hold"):
        compressed_decode_layout(torch.tensor([[3, -1]]), _t(129), _t(128), _t(0), 1, 128)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_tables must be int64"):
        compressed_decode_layout(torch.tensor([[3]], dtype=torch.int32), _t(1), _t(0), _t(0), 1, 4)
    with pytest.raises(ValueError, match="ratio must be a positive int"):
        compressed_decode_layout(torch.tensor([[3]]), _t(1), _t(0), _t(0), 0, 4)
    with pytest.raises(ValueError, match="seq_of_token must index"):
        compressed_decode_layout(torch.tensor([[3]]), _t(1), _t(0), _t(1), 1, 4)
