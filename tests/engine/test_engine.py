import random

import pytest

from deepinfer import LLM, SamplingParams

QUIET = ["engine.use_tqdm=false"]


def _prompts(count: int, seed: int = 0, lengths=(1, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def batched():
    """A small token budget and chunk size force chunked prefill mixed with decodes."""
    return LLM("tiny_random", "reference", QUIET + ["engine.max_num_batched_tokens=48", "engine.prefill_chunk_tokens=16"])


@pytest.fixture(scope="module")
def alone():
    return LLM("tiny_random", "reference", QUIET)


def test_continuous_batching_gives_each_request_its_solo_tokens(batched, alone):
    prompts = _prompts(32)
    params = [_greedy(4 + i % 5) for i in range(32)]
    together = batched.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, together):
        solo = alone.generate([prompt], sp)[0]
        assert out.token_ids == solo.token_ids, f"prompt of {len(prompt)} tokens"
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length"


def test_preemption_by_recompute_completes_every_request_unchanged(alone):
    """Nine usable blocks of 128 tokens for 8 requests that each grow past one block."""
    tight = LLM("tiny_random", "reference", QUIET + ["engine.num_kv_blocks=10", "engine.max_num_seqs=8"])
    prompts = _prompts(8, seed=1, lengths=(120, 127))
    params = _greedy(12)
    outputs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0, "the cache budget did not force a preemption"
    assert sum(o.metrics["preemptions"] for o in outputs) == tight.scheduler.num_preemptions
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == alone.generate([prompt], params)[0].token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(batched, alone):
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=100 + i, ignore_eos=True) for i in range(6)]
    first = [o.token_ids for o in batched.generate(prompts, params)]
    assert first == [o.token_ids for o in batched.generate(prompts, params)]
    assert first[0] == alone.generate([prompts[0]], params[0])[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    assert len({tuple(o.token_ids) for o in alone.generate([prompts[0]] * 4, unseeded)}) > 1


def test_stop_token_ids_stop_strings_and_logprobs(alone):
    prompt = _prompts(1, seed=3)[0]
    free = alone.generate([prompt], _greedy(8))[0]
    stop_at = free.token_ids[3]
    out = alone.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1] and out.finish_reason == "stop"
    stop_text = free.text[2:4]
    if stop_text:
        cut = alone.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop=[stop_text], ignore_eos=True))[0]
        assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop_text)]
    scored = alone.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert len(scored.logprobs) == 3
    for token, top in zip(scored.token_ids, scored.logprobs):
        assert token in top and top[token] == max(top.values()) and len(top) == 2


@pytest.mark.parametrize("prompt,params,match", [
    ("", None, "request 1: the prompt is empty"),
    ([], None, "request 1: the prompt is empty"),
    ([5, 512], None, "prompt token id 512 is outside the vocabulary"),
    ([5, -1], None, "prompt token id -1 is outside"),
    ([7] * 1024, None, "the prompt has 1024 tokens but max_model_len is 1024"),
])
def test_bad_requests_are_refused_and_queued_requests_finish_unharmed(alone, prompt, params, match):
    good = _prompts(2, seed=4)
    expected = [alone.generate([p], _greedy(5))[0].token_ids for p in good]
    queued = [alone.add_request(p, _greedy(5)) for p in good]
    with pytest.raises(ValueError, match=match):
        alone.generate(["fine prompt", prompt], params)
    while not all(r.finished for r in queued):
        alone.step()
    assert [r.output_token_ids for r in queued] == expected
    assert not alone.scheduler.has_work


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(max_tokens=-3), "max_tokens must be a positive int, got -3"),
    (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
    (dict(logprobs=100), "logprobs must be an int in"),
    (dict(top_k=-2), r"top_k must be an int >= -1 \(-1 or 0 disables it\), got -2"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\), got -1"),
    (dict(seed=2**64), r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(stop=5), "stop must be a list \\(strings\\), got int 5"),
    (dict(stop=[1, 2]), "stop must hold non-empty strings"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list \\(token ids\\), got int 7"),
    (dict(structured={"type": "xml", "schema": "a"}), "structured must be a dict with 'type' one of"),
])
def test_bad_sampling_params_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_backend_and_model_are_named():
    with pytest.raises(ValueError, match="nosuchbackend"):
        LLM("tiny_random", "nosuchbackend", QUIET)
    with pytest.raises(ValueError, match="nosuchmodel"):
        LLM("nosuchmodel", "reference", QUIET)


def test_chat_on_a_model_without_a_template_says_so(alone):
    from deepinfer.tokenizer import NoChatTemplateError

    with pytest.raises(NoChatTemplateError, match="chat template"):
        alone.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("filter_order", ["deepinfer", "vllm"])
def test_decoding_filter_order_reaches_the_sample_op(filter_order):
    """``decoding.filter_order`` is what every sampling step hands ``sample``, and what its kept
    set follows: after top-k 3, renormalised, top-p 0.5 keeps at most 2 tokens (vllm); on the full
    softmax it keeps all 3 unless the top two hold half the mass (deepinfer)."""
    llm = LLM("tiny_random", "reference", QUIET + [f"decoding.filter_order={filter_order}"])
    sample, seen = llm.ops._impls["sample"], []

    def recorded(*args, **kwargs):
        seen.append(kwargs.get("filter_order"))
        return sample(*args, **kwargs)

    llm.ops._impls["sample"] = recorded
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, max_tokens=3, seed=5, logprobs=5, ignore_eos=True)
    out = llm.generate(_prompts(2, seed=3), params)
    assert seen and set(seen) == {filter_order}
    kept = [sum(v > float("-inf") for v in step.values()) for o in out for step in o.logprobs]
    assert all(1 <= n <= 3 for n in kept)
    # tiny_random's next-token distributions are flat: on the full softmax top-p 0.5 keeps more than 3
    assert max(kept) == 3 if filter_order == "deepinfer" else max(kept) <= 2, kept
