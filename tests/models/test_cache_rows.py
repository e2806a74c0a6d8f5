"""The paged compressed cache's row arithmetic: logical compressed tokens to flat cache rows."""
import pytest
import torch

from deepinfer.models.deepseek_v41.cache import LayerCache


def _cache(ratio: int) -> LayerCache:
    return LayerCache(ratio, torch.zeros(1, 1, dtype=torch.uint8))


def test_compressed_slots_by_hand():
    cache = _cache(2)  # 64 compressed tokens a block
    tables = torch.tensor([[5, 2], [7, 0]])
    rows = cache.compressed_slots(tables, torch.tensor([0, 0, 1, 1]), torch.tensor([3, 64, 0, -1]))
    assert rows.tolist() == [5 * 64 + 3, 2 * 64 + 0, 7 * 64 + 0, -1]


@pytest.mark.parametrize("ratio", [1, 2])
def test_sequence_rows_lay_out_what_compressed_slots_give_for_every_index(ratio):
    cache = _cache(ratio)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randint(0, 50, (3, 4), generator=gen)
    per_seq = 4 * cache.tokens_per_block
    counts = torch.tensor([0, per_seq // 3, per_seq])
    got = cache.sequence_rows(tables, counts)
    index = torch.arange(per_seq).expand(3, per_seq)
    want = cache.compressed_slots(tables, torch.arange(3)[:, None].expand(3, per_seq),
                                  index.masked_fill(index >= counts[:, None], -1))
    assert got.shape == (3, per_seq) and torch.equal(got, want)
    assert (got[0] == -1).all() and (got[2] >= 0).all()


def test_a_counted_token_in_a_missing_block_is_refused():
    with pytest.raises(ValueError, match="block the block table does not hold"):
        _cache(1).sequence_rows(torch.tensor([[3, -1]]), torch.tensor([129]))
