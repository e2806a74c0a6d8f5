"""Cross-layer cache sharing (DeepInfer's ``SharedLayerTopology``): a compressed layer reads the
compressed KV, index keys or selected keys of the nearest source at or before it.

The layout below has every case: layer 2 reads layer 1's KV but projects its own index keys from
it; layer 5 reads layer 4's KV and index keys and selects its own; layer 6 reads everything of
layer 4 and layer 5's selection."""
import pytest
import torch

from deepinfer.hal import OpTable
from deepinfer.hal.formats import token_format
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS, LayerSources
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import init_random_weights, load_pretrained, official_state_dict, \
    save_pretrained
from tests.models.tiny_model import SequenceRunner, tiny_config

SHARING = dict(num_hidden_layers=7, compress_ratios=[0, 2, 2, 1, 2, 2, 2, 0], index_topk=4,
               kv_source_layer_ids=[1, 3, 4], index_k_source_layer_ids=[1, 2, 3, 4],
               index_source_layer_ids=[1, 2, 3, 4, 5], dspark_target_layer_ids=[1, 3])


@pytest.fixture(scope="module")
def model():
    return init_random_weights(DeepseekV41ForCausalLM(tiny_config(**SHARING), OpTable("reference"),
                                                      max_model_len=256), seed=11)


def test_each_layer_maps_to_the_nearest_source_at_or_before_it(model):
    assert model.cfg.layer_sources == {1: LayerSources(1, 1, 1), 2: LayerSources(1, 2, 2), 3: LayerSources(3, 3, 3),
                                       4: LayerSources(4, 4, 4), 5: LayerSources(4, 4, 5), 6: LayerSources(4, 4, 5)}


def test_a_layer_holds_only_the_weights_of_what_it_owns(model):
    names = set(official_state_dict(model))
    assert "layers.2.attn.compressor.wkv.weight" not in names and "layers.2.attn.indexer.wk.weight" in names
    assert "layers.5.attn.indexer.wq_b.weight" in names and "layers.5.attn.indexer.wk.weight" not in names
    assert not any(n.startswith(("layers.6.attn.indexer", "layers.6.attn.compressor")) for n in names)
    assert "layers.4.attn.compressor.wgate.weight" in names and "layers.4.attn.indexer.k_norm.weight" in names


def test_shared_caches_are_the_sources_tensors_and_not_allocated_twice(model):
    caches = model.allocate_caches(num_blocks=3, num_state_slots=2)
    layers = caches.layers
    assert layers[2].compressed is layers[1].compressed and layers[2].index_k is not layers[1].index_k
    assert layers[5].compressed is layers[4].compressed and layers[5].index_k is layers[4].index_k
    assert layers[6].compressed is layers[4].compressed and layers[6].compress_state is None
    kv, index = token_format("fp4").bytes_per_token, token_format("index_fp4").bytes_per_token
    # KV of layers 1, 3, 4 and index keys of layers 1, 2, 3, 4, by hand
    per_block = 64 * kv + 128 * kv + 64 * kv + 64 * index + 64 * index + 128 * index + 64 * index
    assert model.cache_bytes(1, 0) == per_block
    assert PAGE_TOKENS == 128


SEQS = [list(range(3, 60)), [7, 9] * 20 + [11] * 10]


@pytest.mark.parametrize("decode_path", [True, False], ids=["decode_path", "prefill_path"])
def test_chunked_prefill_then_decode_matches_the_full_forward(decode_path):
    """Sharing layers read their sources' rows written in earlier steps, on both paths: with
    batch-invariant ops (a row's arithmetic independent of the step's shape) chunks of 7 and
    then single tokens give the full forward's logits bit for bit."""
    model = init_random_weights(DeepseekV41ForCausalLM(tiny_config(**SHARING), OpTable("reference", batch_invariant=True),
                                                       max_model_len=256), seed=11)
    want = torch.split(SequenceRunner(model, len(SEQS), 64).step(dict(enumerate(SEQS)), all_logits=True),
                       [len(s) for s in SEQS])
    runner = SequenceRunner(model, len(SEQS), 64)
    got = [[] for _ in SEQS]
    for start in range(0, 30, 7):
        chunks = {s: seq[start:min(start + 7, 30)] for s, seq in enumerate(SEQS)}
        logits = runner.step(chunks, all_logits=True)
        for s, rows in enumerate(torch.split(logits, [len(c) for c in chunks.values()])):
            got[s].append(rows)
    for pos in range(30, min(map(len, SEQS))):
        logits = runner.step({s: [seq[pos]] for s, seq in enumerate(SEQS)}, decode=decode_path)
        for s in range(len(SEQS)):
            got[s].append(logits[s:s + 1])
    for s in range(len(SEQS)):
        rows = torch.cat(got[s])
        assert torch.equal(rows, want[s][:rows.shape[0]]), f"sequence {s}"


def test_sharing_equals_a_consumer_layer_that_copies_its_sources_projections(model):
    """YOCO consumers project compressed KV from one shared hidden, so layer 5 owning its KV and
    index keys with layer 4's compressor and index-key weights would store exactly layer 4's
    rows: that model, which shares nothing at layer 5, must give the same logits."""
    owning = DeepseekV41ForCausalLM(tiny_config(**{**SHARING, "kv_source_layer_ids": [1, 3, 4, 5],
                                                   "index_k_source_layer_ids": [1, 2, 3, 4, 5]}),
                                    OpTable("reference"), max_model_len=256)
    missing, unexpected = owning.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and missing and all(n.startswith("layers.5.attn.") for n in missing)
    source, layer5 = model.layers[4].attn, owning.layers[5].attn
    layer5.compressor.load_state_dict(source.compressor.state_dict())
    layer5.indexer.wk.load_state_dict(source.indexer.wk.state_dict())
    layer5.indexer.k_norm.load_state_dict(source.indexer.k_norm.state_dict())
    tokens = {0: SEQS[0], 1: SEQS[1]}
    want = SequenceRunner(owning, 2, 64).step(tokens, all_logits=True)
    assert torch.equal(SequenceRunner(model, 2, 64).step(tokens, all_logits=True), want)
    layer5.indexer.wk.weight.data.mul_(-1.0)  # and the copy is what made them equal
    assert not torch.equal(SequenceRunner(owning, 2, 64).step(tokens, all_logits=True), want)


def test_write_then_load_gives_identical_logits(model, tmp_path):
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, OpTable("reference"), max_model_len=model.max_model_len)
    assert loaded.cfg.layer_sources == model.cfg.layer_sources
    tokens = {0: list(range(3, 50))}
    assert torch.equal(SequenceRunner(model, 1, 64).step(tokens, all_logits=True),
                       SequenceRunner(loaded, 1, 64).step(tokens, all_logits=True))


@pytest.mark.parametrize("changes,message", [
    (dict(kv_source_layer_ids=[1, 3], index_k_source_layer_ids=[1, 2, 3], index_source_layer_ids=[1, 2, 3, 5]),
     r"layer 4 \(ratio 2\) would share with layers of another ratio"),
    (dict(kv_source_layer_ids=[1, 4], index_k_source_layer_ids=[1, 4]), r"first YOCO consumer layer 3 must be a KV"),
    (dict(index_k_source_layer_ids=[1, 3]), r"KV sources \[1, 3, 4\] must be index-K sources \[1, 3\]"),
    (dict(index_source_layer_ids=[2, 3, 4]), r"index_source_layer_ids=\[2, 3, 4\] must list compressed layers"),
    (dict(kv_source_layer_ids=[1, 4, 3]), r"kv_source_layer_ids=\[1, 4, 3\] must list .* increasing order"),
])
def test_a_topology_deepinfer_does_not_allow_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{**SHARING, **changes})


def test_training_refuses_a_sharing_model(model):
    from deepinfer.models.deepseek_v41.training import check_training_length

    with pytest.raises(ValueError, match="share compressed caches .* not supported yet"):
        check_training_length(model.cfg, 16)
