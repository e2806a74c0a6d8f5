"""Batch-invariant inference end to end (issue 9): 64 seeded prompts at temperature 1, each
generated alone and inside 10 random batch compositions (group sizes, orders, partners, prefill
chunk sizes, token budgets). With ``engine.batch_invariant=true`` every step's logits are
bitwise those of the prompt alone and the tokens are identical, also with DSpark drafting and
verifying (fixed verify length, the first 5 compositions); with it off (slow test) the
differences are counted and reported."""
import importlib.util
import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.hal import BatchInvarianceError, register_backend, unregister_backend
from tests.hal.test_batch_invariance import PlainBackend

MODEL, QUIET = "tiny_random", ["engine.use_tqdm=false"]
PROMPTS, COMPOSITIONS, MAX_TOKENS = 64, 10, 4
DSPARK_MAX_TOKENS, DSPARK_COMPOSITIONS = 8, 5
"""Room for several verify steps of up to 5 drafts, so token budgets cut some of them; the first
5 compositions (each verify step costs a forward of every drafted row on the CPU)."""


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine the hand-offs of many tiny steps cost more
    than they save. Invariance holds per setting; the setting is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _workload(max_tokens: int = MAX_TOKENS, num_compositions: int = COMPOSITIONS):
    """Prompts, their seeded sampling parameters, and compositions: (engine overrides, groups of
    prompt indices generated together)."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 16))] for _ in range(PROMPTS)]
    params = [SamplingParams(temperature=1.0, top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 40]),
                             seed=rng.getrandbits(64), max_tokens=max_tokens, ignore_eos=True)
              for _ in range(PROMPTS)]
    compositions = []
    for _ in range(num_compositions):
        order = rng.sample(range(PROMPTS), PROMPTS)
        sizes = []
        while sum(sizes) < PROMPTS:
            sizes.append(rng.choice([1, 2, 5, 11, 23, 64]))
        groups = [order[sum(sizes[:g]):sum(sizes[:g + 1])] for g in range(len(sizes))]
        chunk = rng.choice([3, 8, 16, 64])
        engine = [f"engine.prefill_chunk_tokens={chunk}", f"engine.max_num_seqs={rng.choice([8, 32])}",
                  f"engine.max_num_batched_tokens={chunk * rng.choice([2, 4, 8])}"]
        compositions.append((engine, groups))
    return prompts, params, compositions


def _generate(llm: LLM, prompts, params, indices) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
    """Prompt index -> (tokens, logits of each step) for the prompts ``indices`` run together."""
    llm.runner.logits_trace = {}
    outputs = llm.generate([prompts[i] for i in indices], [params[i] for i in indices])
    return {i: (out.token_ids, llm.runner.logits_trace[out.request_id]) for i, out in zip(indices, outputs)}


TARGETS = {
    "cpu": ("reference", ["backend.device=cpu"]),
    "cuda": ("reference", ["backend.device=cuda"]),
    "sm100": ("sm100", ["backend.fallback=reference", "model.dtype=bfloat16"]),
}
"""Where the model runs: backend and its overrides. sm100 serves its kernels' ops (bf16
activations) and the reference on the GPU serves the rest."""


def _alone_and_batched(batch_invariant: bool, target: str, decoding: tuple[str, ...] = ()):
    """Each prompt's run alone, and every (prompt index, batched run) of the compositions."""
    backend, overrides = TARGETS[target]
    mode = [f"engine.batch_invariant={str(batch_invariant).lower()}", *overrides, *decoding]
    prompts, params, compositions = (_workload(DSPARK_MAX_TOKENS, DSPARK_COMPOSITIONS) if decoding
                                     else _workload())
    alone_llm = LLM(MODEL, backend, QUIET + mode)
    alone = {}
    for i in range(PROMPTS):
        alone.update(_generate(alone_llm, prompts, params, [i]))
    batched = []
    for engine, groups in compositions:
        llm = LLM(MODEL, backend, QUIET + mode + engine)
        for group in groups:
            batched.extend(_generate(llm, prompts, params, group).items())
    assert len(batched) == PROMPTS * len(compositions)
    return alone, batched


def _differing_steps(run, alone_run) -> list[int]:
    tokens, logits = run
    return [step for step, (got, want) in enumerate(zip(logits, alone_run[1])) if not torch.equal(got, want)]


NO_TILELANG = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                 reason="the sm100 backend needs tilelang (pip install -e '.[sm100]')")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("sm100", marks=[pytest.mark.gpu, NO_TILELANG])]


DSPARK = ("decoding=dspark", "decoding.varlen=false")


@pytest.mark.parametrize("decoding", [(), DSPARK], ids=["plain", "dspark"])
@pytest.mark.parametrize("device", DEVICES)
def test_logits_and_tokens_do_not_depend_on_the_batch(one_thread, device, decoding):
    alone, batched = _alone_and_batched(batch_invariant=True, target=device, decoding=decoding)
    for i, run in batched:
        assert run[0] == alone[i][0], f"prompt {i}: tokens {run[0]} batched, {alone[i][0]} alone"
        assert not _differing_steps(run, alone[i]) and len(run[1]) == len(alone[i][1]), \
            f"prompt {i}: logits differ from the prompt alone at steps {_differing_steps(run, alone[i])}"
        rows = sum(len(step) for step in run[1])
        assert len(run[1]) == MAX_TOKENS if not decoding else rows > len(run[1]), "DSpark verified no drafts"


def test_batch_invariance_with_confidence_scheduled_verification_is_refused():
    with pytest.raises(ValueError, match="needs a fixed verify length with DSpark.*set decoding.varlen=false"):
        LLM(MODEL, "reference", QUIET + ["engine.batch_invariant=true", *DSPARK[:1], "decoding.varlen=true"])


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_without_the_mode_the_differences_are_counted(one_thread, record_property, device):
    alone, batched = _alone_and_batched(batch_invariant=False, target=device)
    token_diffs = logit_diffs = 0
    for i, (tokens, logits) in batched:
        assert len(tokens) == len(logits) == MAX_TOKENS, f"prompt {i}: {len(tokens)} tokens, {len(logits)} steps"
        token_diffs += tokens != alone[i][0]
        logit_diffs += bool(_differing_steps((tokens, logits), alone[i]))
    record_property("batch_invariant_off_logit_diffs", logit_diffs)
    record_property("batch_invariant_off_token_diffs", token_diffs)
    print(f"\n{device}, engine.batch_invariant=false: of {len(batched)} batched runs, {logit_diffs} had logits "
          f"differing from the prompt alone at some step and {token_diffs} had different tokens")


def test_batch_invariance_on_a_backend_without_it_is_refused():
    register_backend(PlainBackend)
    try:
        with pytest.raises(BatchInvarianceError, match="engine.batch_invariant=true, but backend 'plain'"):
            LLM(MODEL, "reference", QUIET + ["backend.name=plain", "backend.fallback=reference",
                                              "engine.batch_invariant=true"])
    finally:
        unregister_backend("plain")
