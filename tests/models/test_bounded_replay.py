"""SWA bounded replay at the model level: ``mask`` and ``compact`` agree, ``compact`` computes
O(keep_tokens) consumer rows, consumer compressed KV stays exact, short prompts are untouched."""
import pytest
import torch

from deepinfer.hal import OpTable
from deepinfer.hal.spec import compare
from deepinfer.models.deepseek_v41.bounded_replay import replay_starts
from deepinfer.models.deepseek_v41.model import STEPWISE_TOLERANCE, DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import init_random_weights
from deepinfer.models.forward_context import ForwardContext
from tests.models.tiny_model import SequenceRunner, tiny_config

KEEP = 14
"""The smallest keep_tokens the tiny_random model allows: window 8 + max_backtracking 6."""


def _tiny_random(batch_invariant: bool = False) -> DeepseekV41ForCausalLM:
    cfg = tiny_config()
    assert cfg.sliding_window + cfg.max_backtracking == KEEP
    ops = OpTable("reference", batch_invariant=batch_invariant)
    return init_random_weights(DeepseekV41ForCausalLM(cfg, ops, max_model_len=256), 0)


@pytest.fixture(scope="module")
def model():
    return _tiny_random()


def _prompts(lengths, seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


class Replay:
    """Drives prompts through ``model`` in one batch: chunked prefill in lockstep, then greedy
    decode steps; ``mode`` is off, mask or compact. Keeps every step's logits rows."""

    def __init__(self, model, prompts, mode, new_tokens=3):
        self.model, self.prompts, self.mode = model, prompts, mode
        self.runner = SequenceRunner(model, len(prompts), max(map(len, prompts)) + new_tokens)
        self.new_tokens, self.logits, self.tokens = new_tokens, [], [[] for _ in prompts]

    def step(self, chunks: dict[int, list[int]], decode=False, logits_indices=None) -> torch.Tensor:
        seqs, runner = sorted(chunks), self.runner
        starts = replay_starts([len(self.prompts[s]) for s in seqs], KEEP) if self.mode != "off" else None
        ctx = ForwardContext.for_sequences([chunks[s] for s in seqs], [runner.lengths[s] for s in seqs],
                                           [s + 1 for s in seqs], [runner.blocks(s) for s in seqs], decode=decode,
                                           logits_rows=logits_indices, replay_starts=starts,
                                           replay_compact=self.mode == "compact")
        with torch.no_grad():
            logits = self.model(ctx, runner.caches)
        for s in seqs:
            runner.lengths[s] += len(chunks[s])
        self.logits.append(logits)
        return logits

    def run(self, chunk: int) -> "Replay":
        longest = max(map(len, self.prompts))
        for start in range(0, longest, chunk):
            chunks = {s: p[start:start + chunk] for s, p in enumerate(self.prompts) if start < len(p)}
            logits = self.step(chunks)
            for row, s in enumerate(sorted(chunks)):
                if start + chunk >= len(self.prompts[s]):
                    self.tokens[s].append(int(logits[row].argmax()))
        for _ in range(self.new_tokens - 1):
            logits = self.step({s: [t[-1]] for s, t in enumerate(self.tokens)}, decode=True)
            for s, row in enumerate(logits):
                self.tokens[s].append(int(row.argmax()))
        return self


def _consumer_layers(model):
    return range(model.cfg.n_prefill_layers, model.cfg.num_hidden_layers)


@pytest.mark.parametrize("lengths,chunk", [((9, 14), 4), ((30, 14), 5), ((61, 9), 7), ((61, 30), 64)],
                         ids=["below_and_at", "above_and_at", "far_above_chunk7", "far_above_one_chunk"])
def test_mask_and_compact_agree(model, lengths, chunk):
    prompts = _prompts(lengths)
    mask = Replay(model, prompts, "mask", new_tokens=2).run(chunk)
    compact = Replay(model, prompts, "compact", new_tokens=2).run(chunk)
    assert compact.tokens == mask.tokens
    for step, (got, want) in enumerate(zip(compact.logits, mask.logits)):
        failures = compare(got, want, STEPWISE_TOLERANCE, f"step {step}")
        assert not failures, "\n".join(failures)


def test_mask_and_compact_are_bitwise_equal_with_batch_invariant_ops():
    model = _tiny_random(batch_invariant=True)
    prompts = _prompts((30,), seed=2)
    mask = Replay(model, prompts, "mask", new_tokens=2).run(8)
    compact = Replay(model, prompts, "compact", new_tokens=2).run(8)
    assert all(torch.equal(a, b) for a, b in zip(compact.logits, mask.logits))
    for i in _consumer_layers(model):
        got, want = compact.runner.caches.layers[i], mask.runner.caches.layers[i]
        assert torch.equal(got.swa_ring, want.swa_ring), f"consumer layer {i} SWA ring"


def test_consumer_compressed_kv_and_index_k_stay_exact(model):
    """Compact computes few consumer rows, yet every consumer compressed token and index key
    equals the untruncated prefill's: long-range context is not approximated."""
    prompts = _prompts((61, 30), seed=3)
    off = Replay(model, prompts, "off", new_tokens=1).run(16)
    compact = Replay(model, prompts, "compact", new_tokens=1).run(16)
    for i, ratio in enumerate(model.cfg.layer_ratios):
        if ratio:
            got, want = compact.runner.caches.layers[i], off.runner.caches.layers[i]
            assert torch.equal(got.compressed, want.compressed) and torch.equal(got.index_k, want.index_k), i
    assert any(model.cfg.layer_ratios[i] for i in _consumer_layers(model))


def test_decode_path_sees_the_same_bounded_window_as_prefill(model):
    """Position 12 of a 24-token prompt (replay_start 10) sees only keys 10..12 in the consumer
    layers, whether it runs as a decode step (ring reads) or in a prefill chunk."""
    prompt = _prompts((24,), seed=4)
    last = {}
    for mode in ("off", "mask"):
        decoded = Replay(model, prompt, mode)
        decoded.step({0: prompt[0][:12]})
        last[mode, "decode"] = decoded.step({0: prompt[0][12:13]}, decode=True)
        last[mode, "prefill"] = Replay(model, prompt, mode).step({0: prompt[0][:13]})
    failures = compare(last["mask", "decode"], last["mask", "prefill"], STEPWISE_TOLERANCE, "position 12")
    assert not failures, "\n".join(failures)
    assert not torch.allclose(last["mask", "prefill"], last["off", "prefill"], atol=1e-2), \
        "the bounded window changed nothing, so this test cannot tell the paths apart"


def test_prompts_within_keep_tokens_are_untouched(model):
    prompts = _prompts((KEEP, 5), seed=5)
    off = Replay(model, prompts, "off", new_tokens=2).run(4)
    compact = Replay(model, prompts, "compact", new_tokens=2).run(4)
    assert compact.tokens == off.tokens
    assert all(torch.equal(a, b) for a, b in zip(compact.logits, off.logits))


def _kept_rows(length: int, chunk: int) -> int:
    """Hand count: positions >= length - KEEP, plus one row per chunk that ends before them."""
    first_kept = max(0, length - KEEP)
    return sum(end - max(start, first_kept) if end > first_kept else 1
               for start, end in ((s, min(s + chunk, length)) for s in range(0, length, chunk)))


@pytest.mark.parametrize("length,chunk,expected", [(10, 10, 10), (61, 16, 16), (200, 64, 16), (200, 200, 14)])
def test_compact_consumer_rows_grow_with_keep_tokens_not_the_prompt(model, length, chunk, expected):
    assert _kept_rows(length, chunk) == expected
    counts = {}

    def counter(name):
        def hook(module, args):
            counts[name] = counts.get(name, 0) + args[0].shape[0]
        return hook

    consumer = model.cfg.n_prefill_layers
    compressed = next(i for i in _consumer_layers(model) if model.cfg.layer_ratios[i])
    handles = [model.layers[0].attn.register_forward_pre_hook(counter("producer")),
               model.layers[consumer].attn.register_forward_pre_hook(counter("consumer")),
               model.layers[consumer].ffn.register_forward_pre_hook(counter("consumer_moe"))]
    attn = model.layers[compressed].attn
    store = attn._store_compressed

    def counted_store(latent, *args):  # the rows the consumer's compressor projects and stores
        counter("consumer_kv_store")(None, (latent,))
        return store(latent, *args)

    attn._store_compressed = counted_store
    try:
        for mode in ("off", "compact"):
            counts.clear()
            Replay(model, _prompts((length,)), mode, new_tokens=1).run(chunk)
            want_consumer = length if mode == "off" else expected
            assert counts == {"producer": length, "consumer": want_consumer, "consumer_moe": want_consumer,
                              "consumer_kv_store": length}, mode
    finally:
        del attn._store_compressed
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_logits_of_rows_the_consumers_skip_are_refused(model, mode):
    replay = Replay(model, _prompts((30,)), mode)
    with pytest.raises(ValueError, match=r"logits of row 3 \(position 3 of sequence 0\).*replay_start 16"):
        replay.step({0: replay.prompts[0]}, logits_indices=[3, 29])


def test_compact_without_replay_start_is_refused(model):
    runner = SequenceRunner(model, 1, 8)
    ctx = ForwardContext.for_sequences([[5, 6, 7]], [0], [1], [runner.blocks(0)])
    ctx.replay_compact = True
    with pytest.raises(ValueError, match=r"needs ctx.replay_start as int64 \[num_seqs=1\], got None"):
        model(ctx, runner.caches)
