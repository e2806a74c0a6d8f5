"""The soak experiment in its fast mode: 100 requests of random lengths and kinds (greedy, seeded
sampling, regex and JSON outputs, all drafted by DSpark) on a KV budget that preempts again and
again, with batch invariance on: all complete once, none failed, and requests run again alone
give the same tokens."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
SPEC = importlib.util.spec_from_file_location("soak", Path(__file__).parents[2] / "experiments" / "soak.py")
soak = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(soak)


def test_every_request_completes_once_under_repeated_preemption():
    result = soak.soak("tiny_random", "reference", ["decoding=dspark", "engine.batch_invariant=true",
                                                    "engine.prefill_chunk_tokens=64"],
                       requests=100, max_prompt=250, max_output=8, kv_blocks=4, check_alone=4)
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
