"""The soak experiment in its fast mode: 100 requests of random lengths and kinds (greedy, seeded
sampling, regex and JSON outputs, all drafted by DSpark) on a KV budget that preempts again and
again, with batch invariance on: all complete once, none failed, and requests run again alone
give the same tokens."""
import pytest

from deepinfer.study import compose_study, load_script

pytest.importorskip("xgrammar")
soak = load_script("soak")


def test_every_request_completes_once_under_repeated_preemption():
    app, settings = compose_study("soak", soak.Settings, ["study.fast=true", "engine.batch_invariant=true"])
    assert settings.requests == 100 and app.decoding.num_draft_tokens == 5
    result = soak.soak(app, settings)
    assert result["completed"] == result["submitted"] == 100
    assert result["preempted"] >= 20, result
    assert not any(key.endswith(":error") for key in result), result
    assert result["alone_equal"] == result["alone_checked"] == 4


def test_a_lost_or_short_request_is_caught():
    from deepinfer import SamplingParams
    from deepinfer.engine.outputs import RequestOutput

    made = [("greedy", [5], SamplingParams(max_tokens=4))]
    short = RequestOutput(request_id=0, prompt=None, prompt_token_ids=[5], text="", token_ids=[1, 2],
                          finish_reason="length")
    with pytest.raises(RuntimeError, match="ended 'length' with 2 of 4 tokens"):
        soak.check_outputs(made, [short])
    with pytest.raises(RuntimeError, match="1 requests submitted, 0 outputs"):
        soak.check_outputs(made, [])
