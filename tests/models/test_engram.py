"""Engram memory in the model: hash constants, each row's n-gram history across steps (chunks,
decode, verify blocks with rejected drafts), the injection between post and pre, and refusals."""
import numpy as np
import pytest
import torch

from deepinfer.hal import OpTable
from deepinfer.hal.registry import OpUnavailableError
from deepinfer.models.deepseek_v41.engram import hash_multipliers, is_prime, ngram_token_ids, table_sizes
from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.forward_context import ForwardContext
from tests.models.test_bounded_replay import Replay, _prompts
from tests.models.tiny_model import ENGRAM, SequenceRunner, tiny_config, tiny_engram_model

SEQS = [list(range(5, 45)), [7, 9] * 15 + [11] * 5]


@pytest.fixture(scope="module")
def model():
    return tiny_engram_model()


@pytest.fixture(scope="module")
def full_logits(model):
    return SequenceRunner(model, len(SEQS), 64).step(dict(enumerate(SEQS)), all_logits=True)


def test_table_sizes_are_distinct_primes_from_the_vocab_size_in_config_order():
    """Layer 0 takes 37, 41 (order 2) and 43, 47 (order 3); layer 3 the next free primes."""
    assert table_sizes(tiny_config(**ENGRAM)) == [[[37, 41], [43, 47]], [[53, 59], [61, 67]]]
    big = tiny_config(**{**ENGRAM, "engram_layer_ids": [2, 0, 1], "engram_max_ngram_size": 4,
                         "engram_n_heads": 3, "engram_vocab_size": 100_000})
    sizes = [p for layer in table_sizes(big) for order in layer for p in order]
    assert len(sizes) == 3 * 3 * 3 == len(set(sizes)) and min(sizes) >= 100_000 and all(map(is_prime, sizes))
    assert [p for p in range(99_990, 100_050) if is_prime(p)] == [99_991, 100_003, 100_019, 100_043, 100_049]
    assert table_sizes(big)[0][0] == [100_003, 100_019, 100_043]  # the first layer listed takes the first primes


def test_multipliers_are_odd_and_seeded_per_layer():
    multipliers = hash_multipliers([0, 3], order=3, compressed_size=1000)
    bound = np.iinfo(np.int64).max // 1000 // 2
    assert multipliers.shape == (2, 3) and (multipliers % 2 == 1).all() and (multipliers < 2 * bound + 1).all()
    assert multipliers[1].tolist() == (np.random.default_rng(3 * 10007).integers(0, bound, 3) * 2 + 1).tolist()
    assert hash_multipliers([3], 3, 1000).tolist() == multipliers[1:].tolist()


def _ids(history, tokens, starts, slots, decode=False):
    ctx = ForwardContext.for_sequences(tokens, starts, slots, [[1]] * len(tokens), decode=decode)
    return ngram_token_ids(ctx, history, order=3, pad_token=2).tolist()


def test_history_pads_before_the_start_and_crosses_steps_and_rejected_drafts():
    history = torch.zeros(3, tiny_config(**ENGRAM).engram_history_tokens + 1, dtype=torch.int64)
    assert _ids(history, [[10, 11, 12], [50]], [0, 0], [1, 2]) == [[10, 2, 2], [11, 10, 2], [12, 11, 10], [50, 2, 2]]
    assert _ids(history, [[13, 14], [51]], [3, 1], [1, 2]) == [[13, 12, 11], [14, 13, 12], [51, 50, 2]]
    # a verify block at position 5 whose first draft (90) is accepted, the others rejected
    assert _ids(history, [[15, 90, 91, 92]], [5], [1], decode=True) == [[15, 14, 13], [90, 15, 14], [91, 90, 15],
                                                                       [92, 91, 90]]
    assert _ids(history, [[16, 93, 94, 95]], [7], [1], decode=True)[0] == [16, 90, 15]
    # a new sequence in a used slot sees only pads before its start
    assert _ids(history, [[60, 61]], [0], [1]) == [[60, 2, 2], [61, 60, 2]]


@pytest.mark.parametrize("decode_path", [True, False], ids=["decode_path", "prefill_path"])
def test_chunked_prefill_then_decode_equals_one_prefill(model, full_logits, decode_path):
    """Batch-invariant ops: every other step shape must give the same bits, so a row whose
    history crossed a step boundary wrongly would show."""
    runner = SequenceRunner(model, len(SEQS), 64)
    got = [[] for _ in SEQS]
    for start in range(0, 21, 7):
        chunks = {s: seq[start:start + 7] for s, seq in enumerate(SEQS)}
        for s, rows in enumerate(torch.split(runner.step(chunks, all_logits=True), 7)):
            got[s].append(rows)
    for pos in range(21, min(map(len, SEQS))):
        logits = runner.step({s: [seq[pos]] for s, seq in enumerate(SEQS)}, decode=decode_path)
        for s in range(len(SEQS)):
            got[s].append(logits[s:s + 1])
    for s, want in enumerate(torch.split(full_logits, [len(seq) for seq in SEQS])):
        rows = torch.cat(got[s])
        assert torch.equal(rows, want[:len(rows)]), f"sequence {s}"


def test_verify_blocks_with_rejected_drafts_equal_one_prefill(model, full_logits):
    """Verify steps of 4 rows (the golden token and 3 drafts), of which only some are accepted."""
    seq, runner = SEQS[0], SequenceRunner(model, 1, 64)
    runner.step({0: seq[:10]})
    position, got = 10, {}
    for accepted in (0, 2, 3, 1):
        block = seq[position:position + 1 + accepted] + [500, 501, 502][:3 - accepted]
        logits = runner.step({0: block}, decode=True, all_logits=True)
        for row in range(accepted + 1):
            got[position + row] = logits[row]
        position += accepted + 1
        runner.lengths[0] = position
    want = full_logits[:len(seq)]
    assert all(torch.equal(row, want[pos]) for pos, row in got.items()) and len(got) == 10


def test_the_history_and_the_memory_change_the_logits(model, full_logits):
    """Control: wiping the recorded history between steps, or the memory's value, changes them."""
    runner = SequenceRunner(model, 1, 64)
    runner.step({0: SEQS[0][:20]})
    runner.caches.engram_history.zero_()
    assert not torch.equal(runner.step({0: SEQS[0][20:25]}, all_logits=True), full_logits[20:25])
    silent = tiny_engram_model()
    silent.layers[0].engram.wkv.weight.data.zero_()
    silent.layers[3].engram.wkv.weight.data.zero_()
    assert not torch.equal(SequenceRunner(silent, 1, 64).step({0: SEQS[0]}, all_logits=True),
                           full_logits[:len(SEQS[0])])


def test_attention_reads_the_trunk_after_the_injection(model):
    """Post mix, injection, then the pre mix and attn_norm: layer 3's attention input is its norm
    of the injected trunk read with layer 2's ffn pre mix; layer 0's, of stream 0 of the injected
    embedding."""
    seen = {}
    hooks = [model.layers[i].engram.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("trunk", i), out))
             for i in (0, 3)]
    hooks += [model.layers[i].attn.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("x", i), a[0]))
              for i in (0, 3)]
    mixes = model.layers[2].hc_ffn.mixes
    model.layers[2].hc_ffn.mixes = lambda residual: seen.setdefault("ffn mixes", mixes(residual))
    try:
        SequenceRunner(model, 1, 64).step({0: SEQS[0][:12]})
    finally:
        del model.layers[2].hc_ffn.mixes
        for hook in hooks:
            hook.remove()
    layer0, layer3 = model.layers[0], model.layers[3]
    assert torch.equal(seen["x", 0], layer0.attn_norm(seen["trunk", 0][:, 0]))
    pre = seen["ffn mixes"][0]
    assert torch.equal(seen["x", 3], layer3.attn_norm(model.ops.mhc_pre(seen["trunk", 3], pre)))


def test_non_shifted_hyper_connections_inject_before_the_mixes():
    model = tiny_engram_model(hc_shifted=False, engram_layer_ids=[0, 2])
    seq = SEQS[0][:30]
    full = SequenceRunner(model, 1, 64).step({0: seq}, all_logits=True)
    runner = SequenceRunner(model, 1, 64)
    rows = [runner.step({0: seq[:20]}, all_logits=True)] + [runner.step({0: [t]}, decode=True) for t in seq[20:]]
    assert torch.equal(torch.cat(rows), full)


def test_mask_and_compact_replay_agree_with_engram_in_the_consumer_half(model):
    assert 3 in model.cfg.engram_layer_ids and model.cfg.n_prefill_layers <= 3
    prompts = _prompts((30,), seed=2)
    mask = Replay(model, prompts, "mask", new_tokens=2).run(8)
    compact = Replay(model, prompts, "compact", new_tokens=2).run(8)
    assert all(torch.equal(a, b) for a, b in zip(compact.logits, mask.logits))


@pytest.mark.parametrize("changes,message", [
    (dict(engram_layer_ids=[1, 1]), r"engram_layer_ids=\[1, 1\] must name distinct backbone layers 0..3"),
    (dict(engram_layer_ids=[4]), r"must name distinct backbone layers"),
    (dict(engram_head_dim=48), r"engram_head_dim=48 must be a multiple of 32"),
    (dict(engram_vocab_size=None), r"engram_vocab_size=None: Engram layers \[0, 3\] need it as an int >= 2"),
    (dict(engram_max_ngram_size=1), r"engram_max_ngram_size=1"),
    (dict(engram_compressed_vocab_size=None), r"engram_compressed_vocab_size=None: .*tokenizer compression"),
    (dict(engram_pad_token_id=512), r"engram_pad_token_id=512 must be a token id"),
])
def test_a_bad_engram_config_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{**ENGRAM, **changes})


def test_a_backend_without_the_engram_ops_fails_at_build_time():
    cfg, vocab = tiny_config(**ENGRAM), CompressedVocab.identity(512)
    with pytest.raises(OpUnavailableError, match=r"HAL op 'engram_hash'.*backend 'sm100'.*backend=reference"):
        DeepseekV41ForCausalLM(cfg, OpTable("sm100"), engram_vocab=vocab)
    built = DeepseekV41ForCausalLM(cfg, OpTable("sm100", fallback="reference"), engram_vocab=vocab)
    assert built.ops.sources["engram_gate"] == "reference"


def test_a_model_without_its_compressed_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"need the compressed vocabulary .* CompressedVocab.identity"):
        DeepseekV41ForCausalLM(tiny_config(**ENGRAM), OpTable("reference"))
    with pytest.raises(ValueError, match=r"has 100 token ids, fewer than the model's vocab_size 512"):
        DeepseekV41ForCausalLM(tiny_config(**ENGRAM), OpTable("reference"), engram_vocab=CompressedVocab.identity(100))


def test_training_refuses_engram(model):
    from deepinfer.models.deepseek_v41.training import check_training_length

    with pytest.raises(ValueError, match=r"Engram layers \(\[0, 3\]\) is not supported yet"):
        check_training_length(model.cfg, 16)
