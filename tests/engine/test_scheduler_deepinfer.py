"""``engine.scheduler=deepinfer``: DeepInfer's step composition, prefill attempt points, whole-prompt
FIFO admission, victim choice and stopped structured requests."""
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import ConfigError
from deepinfer.engine.kv_manager import KVManager
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler_deepinfer import DeepInferScheduler

QUIET = ["engine.use_tqdm=false"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _request(i, prompt_len, outputs=0):
    request = Request(i, None, [5] * prompt_len, SamplingParams(max_tokens=100), seed=0)
    request.output_token_ids = [7] * outputs
    return request


def _decoding(scheduler, request):
    """Put ``request`` in ``scheduler`` as a running request with its prompt and outputs computed
    but its last output (one token pending)."""
    scheduler.kv.reserve(request, request.num_tokens)
    request.status, request.num_computed = Status.RUNNING, request.num_tokens - 1
    scheduler.running.append(request)


def _run(scheduler, batch):
    """What the engine does with a scheduled batch: computed tokens advance, decodes emit one."""
    for chunk in batch.chunks:
        chunk.request.num_computed += len(chunk.token_ids)
        if chunk.samples:
            chunk.request.output_token_ids.append(7)


def test_prefill_is_tried_every_interval_decode_steps_and_steps_never_mix():
    scheduler = DeepInferScheduler(KVManager(64, 8, 128), 8, 64, 64, prefill_interval=5)
    for i in range(2):
        _decoding(scheduler, _request(i, 10, outputs=3))
    scheduler.add(_request(9, 20))
    kinds = []
    for _ in range(8):
        batch = scheduler.schedule()
        prefill = [c.start < len(c.request.prompt_token_ids) for c in batch.chunks]
        assert all(prefill) or not any(prefill), "a step is all prefill or all decode"
        kinds.append("P" if all(prefill) else "D")
        _run(scheduler, batch)
    assert "".join(kinds) == "DDDDDPDD"


def test_no_prefill_attempt_while_the_cache_is_over_the_limit():
    kv = KVManager(11, 8, 128)
    scheduler = DeepInferScheduler(kv, 8, 64, 64, prefill_interval=1)
    for i in range(2):
        _decoding(scheduler, _request(i, 128 * 5 - 4, outputs=2))  # 10 of 10 blocks
    scheduler.add(_request(9, 4))
    for _ in range(3):
        batch = scheduler.schedule()
        assert all(c.request.request_id != 9 for c in batch.chunks) and kv.usage > 0.9
        _run(scheduler, batch)


def test_admission_is_whole_prompt_fifo_with_one_chunked_prompt():
    kv = KVManager(32, 8, 128)
    scheduler = DeepInferScheduler(kv, 8, 100, 100)
    for request in (_request(0, 30), _request(1, 150), _request(2, 10)):
        scheduler.add(request)
    first = scheduler.schedule()
    assert [(c.request.request_id, len(c.token_ids)) for c in first.chunks] == [(0, 30), (1, 70)]
    assert len(scheduler.running[1].blocks) == 2, "blocks for the whole 150-token prompt are reserved at admission"
    _run(scheduler, first)
    second = scheduler.schedule()
    # the chunked prompt goes on; request 2 fits whole beside it, no second prompt is chunked
    assert [(c.request.request_id, len(c.token_ids)) for c in second.chunks] == [(1, 80), (2, 10)]


@pytest.mark.parametrize("structured", [False, True], ids=["requeued", "stopped"])
def test_preemption_evicts_the_longest_output_and_stops_a_structured_one(structured):
    """Three usable blocks, one each: A's next token needs a second, and B (the longest output, 30
    tokens) is the victim; requeued, or stopped with an error when structured."""
    stopped = []
    scheduler = DeepInferScheduler(KVManager(4, 8, 128), 8, 64, 64,
                                   stop=lambda r, reason: (stopped.append((r.request_id, reason)),
                                                           scheduler.finish(r, reason)))
    a, b, c = _request(0, 120, outputs=8), _request(1, 70, outputs=30), _request(2, 60, outputs=5)
    b.grammar = object() if structured else None
    for request in (a, b, c):
        _decoding(scheduler, request)
    assert [len(r.blocks) for r in (a, b, c)] == [1, 1, 1]
    a.output_token_ids.append(7)  # 129 tokens, 128 computed: its next step needs a second block
    a.num_computed += 1
    batch = scheduler.schedule()
    assert {ch.request.request_id for ch in batch.chunks} == {0, 2}
    if structured:
        assert stopped == [(1, "error")] and b.finished and "preempted" in b.error
    else:
        assert not stopped and b.status is Status.WAITING and b.num_computed == 0 and b in scheduler.waiting
        assert b.replay_length == 70 + 30, "bounded replay of the recompute counts prompt and outputs"


def test_the_decode_budget_must_hold_every_request_with_its_drafts():
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=64 must be at least max_num_seqs x "
                                          r"\(1 \+ num_draft_tokens\) = 96"):
        LLM("tiny_random", "reference", QUIET + ["engine.scheduler=deepinfer", "engine.max_num_seqs=16",
                                                 "engine.max_num_batched_tokens=64", "engine.prefill_chunk_tokens=64",
                                                 "decoding=dspark"])


@pytest.mark.parametrize("decoding", [[], ["decoding=dspark"]], ids=["plain", "dspark"])
def test_the_preset_generates_what_the_default_scheduler_does(decoding):
    prompts = [[3 + (7 * i + j) % 400 for j in range(5 + 9 * i)] for i in range(6)]
    default = LLM("tiny_random", "reference", QUIET + decoding + ["engine.max_num_seqs=4"]).generate(prompts, GREEDY)
    deepinfer = LLM("tiny_random", "reference", QUIET + decoding + ["engine=deepinfer", "engine.max_num_seqs=4"])
    outputs = deepinfer.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in default]


def test_the_first_decode_after_prefill_verifies_no_drafts(monkeypatch):
    """DeepInfer drafts only after decode steps: no draft pass follows a prefill chunk."""
    from deepinfer.decoding.dspark import DSpark

    after_prefill, original = [], DSpark.launch

    def spy(self, chunks):
        after_prefill.extend(c.start < len(c.request.prompt_token_ids) for c in chunks)
        return original(self, chunks)

    monkeypatch.setattr(DSpark, "launch", spy)
    prompt = [[17, 99, 230, 5]]
    ours = LLM("tiny_random", "reference", QUIET + ["decoding=dspark"]).generate(prompt, GREEDY)[0]
    assert after_prefill[0] and not any(after_prefill[1:])
    after_prefill.clear()
    deepinfer = LLM("tiny_random", "reference", QUIET + ["decoding=dspark", "engine=deepinfer"]).generate(prompt,
                                                                                                       GREEDY)[0]
    assert after_prefill and not any(after_prefill)
    assert deepinfer.token_ids == ours.token_ids and deepinfer.verify_log
