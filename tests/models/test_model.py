import pytest
import torch

from deepinfer.hal.spec import compare
from deepinfer.models.deepseek_v41.model import STEPWISE_TOLERANCE
from tests.models.tiny_model import SequenceRunner, tiny_model

LENGTHS = (41, 23, 34)


def _sequences(vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, batch_invariant=True)


@pytest.fixture(scope="module")
def full_logits(model):
    """Every position's logits from one forward over the whole batch."""
    seqs = _sequences(model.cfg.vocab_size)
    runner = SequenceRunner(model, len(seqs), max(LENGTHS))
    logits = runner.step(dict(enumerate(seqs)), all_logits=True)
    return seqs, list(torch.split(logits, list(LENGTHS)))


def test_config_has_every_layer_kind(model):
    cfg = model.cfg
    assert set(cfg.layer_ratios) == {0, 1, 2}
    assert 0 < cfg.n_prefill_layers < cfg.num_hidden_layers
    assert max(LENGTHS) > cfg.sliding_window + cfg.max_backtracking
    assert max(LENGTHS) // 2 > cfg.index_topk, "contexts must exceed index_topk so the indexer selects"


@pytest.mark.parametrize("decode_path", [True, False], ids=["decode_path", "prefill_path"])
def test_chunked_prefill_then_decode_matches_full_forward(model, full_logits, decode_path):
    seqs, want = full_logits
    prompt_lens = (13, 9, 20)
    runner = SequenceRunner(model, len(seqs), max(LENGTHS))
    got = [[] for _ in seqs]
    chunk = 6
    for start in range(0, max(prompt_lens), chunk):
        chunks = {s: seq[start:min(start + chunk, prompt_lens[s])] for s, seq in enumerate(seqs)
                  if start < prompt_lens[s]}
        logits = runner.step(chunks, all_logits=True)
        for s, rows in zip(sorted(chunks), torch.split(logits, [len(chunks[s]) for s in sorted(chunks)])):
            got[s].append(rows)
    for pos in range(min(prompt_lens), max(LENGTHS)):
        active = {s: [seq[pos]] for s, seq in enumerate(seqs) if prompt_lens[s] <= pos < len(seq)}
        if not active:
            continue
        logits = runner.step(active, decode=decode_path)
        for row, s in enumerate(sorted(active)):
            got[s].append(logits[row:row + 1])
    for s in range(len(seqs)):  # batch-invariant ops: the same arithmetic per row, so the same bits
        assert torch.equal(torch.cat(got[s]), want[s]), compare(torch.cat(got[s]), want[s], STEPWISE_TOLERANCE,
                                                                 f"sequence {s}")


def test_each_sequence_alone_matches_the_batch(model, full_logits):
    seqs, want = full_logits
    for s, seq in enumerate(seqs):
        runner = SequenceRunner(model, 1, len(seq))
        alone = runner.step({0: seq}, all_logits=True)
        failures = compare(alone, want[s], STEPWISE_TOLERANCE, f"sequence {s} alone")
        assert not failures, "\n".join(failures)


def test_logits_depend_on_context_beyond_the_window(model):
    """Compressed keys carry long-range context: changing a token far outside the SWA window
    must change the last position's logits."""
    seq = _sequences(model.cfg.vocab_size, seed=3)[0]
    changed = list(seq)
    changed[0] = (changed[0] + 1) % model.cfg.vocab_size
    last = []
    for tokens in (seq, changed):
        last.append(SequenceRunner(model, 1, len(tokens)).step({0: tokens}))
    assert len(seq) - 1 > model.cfg.sliding_window
    assert not torch.allclose(last[0], last[1])


def test_yoco_consumers_project_compressed_kv_from_the_shared_hidden(model):
    """Zeroing a consumer layer's compressor changes the logits; that layer's compressed keys
    depend only on the shared hidden, so the producer half is untouched."""
    cfg = model.cfg
    consumer = next(i for i in range(cfg.n_prefill_layers, cfg.num_hidden_layers) if cfg.layer_ratios[i])
    seq = _sequences(cfg.vocab_size, seed=4)[0]
    before = SequenceRunner(model, 1, len(seq)).step({0: seq})
    weight = model.layers[consumer].attn.compressor.wkv.weight
    saved = weight.clone()
    try:
        with torch.no_grad():
            weight.zero_()
        after = SequenceRunner(model, 1, len(seq)).step({0: seq})
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert not torch.allclose(before, after)


def test_out_of_range_token_is_refused(model):
    runner = SequenceRunner(model, 1, 8)
    with pytest.raises(ValueError, match="token ids must be in"):
        runner.step({0: [model.cfg.vocab_size]})
