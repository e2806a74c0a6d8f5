"""``LLM.abort`` and an interrupted ``generate`` free every block and state slot, and leave the
other requests untouched."""
import pytest

from deepinfer import LLM, SamplingParams

QUIET = ["engine.use_tqdm=false", "engine.max_num_seqs=2"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3] * 5, [7, 7, 8], [11, 12, 13, 14, 15], [20, 21]]


def _free(llm):
    return len(llm.scheduler.kv.free_blocks), len(llm.scheduler.kv.free_slots)


@pytest.mark.parametrize("overrides", [[], ["engine.async_scheduling=true", "engine.cuda_graphs=true"]],
                         ids=["sync", "async"])
def test_abort_frees_a_running_and_a_waiting_request_and_spares_the_rest(overrides):
    llm = LLM("tiny_random", "reference", QUIET + overrides)
    alone = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    start = _free(llm)
    requests = [llm.add_request(p, PARAMS) for p in PROMPTS]
    llm.step()
    llm.step()
    running, waiting = requests[0], requests[3]
    assert running.status.value == "running" and waiting.status.value == "waiting"
    assert llm.abort(running.request_id) and llm.abort(waiting.request_id)
    assert not llm.abort(running.request_id), "an aborted request cannot be aborted again"
    assert not llm.abort(10_000)
    while llm.scheduler.has_work:
        llm.step()
    llm.drain()
    assert _free(llm) == start
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert len(running.output_token_ids) < 12 and waiting.output_token_ids == []
    assert [r.output_token_ids for r in requests[1:3]] == alone[1:3]


@pytest.mark.parametrize("overrides", [[], ["engine.async_scheduling=true", "engine.cuda_graphs=true"]],
                         ids=["sync", "async"])
def test_an_interrupted_generate_frees_everything_and_the_engine_runs_on(monkeypatch, overrides):
    llm = LLM("tiny_random", "reference", QUIET + overrides)
    start = _free(llm)
    calls = {"n": 0}
    original = LLM.step

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(LLM, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.setattr(LLM, "step", original)
    assert _free(llm) == start and not llm.scheduler.has_work
    outputs = llm.generate(PROMPTS[:2], PARAMS)
    assert all(len(o.token_ids) == 12 for o in outputs)
