"""Candidate-block top-k (DeepInfer's two-stage indexer): layer 4 keeps the best blocks of its
indexer logits, and the later layers of its ratio (5, 6) select their keys inside them."""
import pytest
import torch

from deepinfer.hal import OpTable
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import init_random_weights
from tests.models.tiny_model import SequenceRunner, tiny_config

LAYOUT = dict(num_hidden_layers=7, compress_ratios=[0, 2, 2, 1, 2, 2, 2, 0], index_topk=8,
              dspark_target_layer_ids=[1, 3])
CANDIDATES = dict(candidate_source_layer_id=4, candidate_block_size=4, candidate_topk_blocks=3)
SEQS = [list(range(3, 60)), list(range(100, 150))]


def _model(batch_invariant=False, **config):
    ops = OpTable("reference", batch_invariant=batch_invariant)
    model = DeepseekV41ForCausalLM(tiny_config(**LAYOUT, **config), ops, max_model_len=256)
    return init_random_weights(model, seed=13)


@pytest.fixture(scope="module")
def model():
    return _model(**CANDIDATES)


def _spy(model, ops=("candidate_blocks", "indexer_topk")):
    calls, impls = [], model.ops._impls
    saved = {op: impls[op] for op in ops}
    for op in ops:
        def call(*args, _op=op, **kwargs):
            out = saved[_op](*args, **kwargs)
            calls.append((_op, args, kwargs, out))
            return out
        impls[op] = call
    return calls, lambda: impls.update(saved)


def test_later_layers_select_only_inside_the_source_layers_blocks(model):
    calls, restore = _spy(model)
    try:
        SequenceRunner(model, 2, 80).step(dict(enumerate(SEQS)))
    finally:
        restore()
    ops_called = [c[0] for c in calls]
    # layers 1, 2 (producers) select, layer 3 selects, layer 4 keeps blocks and selects, 5 and 6 select
    assert ops_called == ["indexer_topk"] * 3 + ["candidate_blocks"] + ["indexer_topk"] * 3
    mask, lengths = calls[3][3], calls[3][1][2]
    assert (mask.sum(dim=1) < lengths).any(), "some window must be longer than the kept blocks"
    for _, args, _, selected in calls[5:]:
        logits, starts = args[0], args[1]
        assert torch.isinf(logits[~mask]).all() and torch.isfinite(logits[mask]).all()
        for t in range(selected.shape[0]):
            picked = selected[t][selected[t] >= 0].long() + starts[t]
            assert mask[t, picked].all()


def test_blocks_that_cover_every_key_change_nothing():
    """With blocks enough for the longest window, every key stays a candidate: the model must give
    exactly the logits of the same weights without candidate blocks."""
    wide = _model(candidate_source_layer_id=4, candidate_block_size=2, candidate_topk_blocks=64)
    plain = _model()
    tokens = dict(enumerate(SEQS))
    assert torch.equal(SequenceRunner(wide, 2, 80).step(tokens, all_logits=True),
                       SequenceRunner(plain, 2, 80).step(tokens, all_logits=True))


def test_restricting_changes_the_logits(model):
    plain = _model()
    tokens = dict(enumerate(SEQS))
    assert not torch.allclose(SequenceRunner(model, 2, 80).step(tokens, all_logits=True),
                              SequenceRunner(plain, 2, 80).step(tokens, all_logits=True))


@pytest.mark.parametrize("decode_path", [True, False], ids=["decode_path", "prefill_path"])
def test_chunked_prefill_then_decode_matches_the_full_forward(decode_path):
    """With batch-invariant ops a row's logits do not depend on how the sequence was cut into
    steps, so chunks of 9 and then single tokens give the full forward's logits bit for bit
    (without them, accumulation order can flip a near-tie of expert routing or key selection)."""
    model = _model(batch_invariant=True, **CANDIDATES)
    want = torch.split(SequenceRunner(model, 2, 80).step(dict(enumerate(SEQS)), all_logits=True),
                       [len(s) for s in SEQS])
    runner = SequenceRunner(model, 2, 80)
    got = [[] for _ in SEQS]
    for start in range(0, 40, 9):
        chunks = {s: seq[start:min(start + 9, 40)] for s, seq in enumerate(SEQS)}
        for s, rows in enumerate(torch.split(runner.step(chunks, all_logits=True), [len(c) for c in chunks.values()])):
            got[s].append(rows)
    for pos in range(40, min(map(len, SEQS))):  # past 40 tokens: 20 keys of ratio 2, more than 3 blocks of 4
        logits = runner.step({s: [seq[pos]] for s, seq in enumerate(SEQS)}, decode=decode_path)
        for s in range(len(SEQS)):
            got[s].append(logits[s:s + 1])
    for s in range(len(SEQS)):
        rows = torch.cat(got[s])
        assert torch.equal(rows, want[s][:rows.shape[0]]), f"sequence {s}"


@pytest.mark.parametrize("changes,message", [
    (dict(candidate_source_layer_id=1), r"another ratio than the source's \(\[3\], source 1 of ratio 2\)"),
    (dict(candidate_topk_blocks=2), r"= 8 must hold index_topk \+ block_size - 1 = 11 keys"),
    (dict(candidate_source_layer_id=0), r"candidate_source_layer_id=0 must be a compressed layer"),
    (dict(candidate_block_size=None), r"must be ints >= 1, got 3 and None"),
])
def test_a_candidate_config_this_build_cannot_honour_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**LAYOUT, **{**CANDIDATES, **changes})
