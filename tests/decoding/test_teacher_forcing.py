"""Teacher forcing (``golden_token_ids``): the outputs are the golden tokens, and a DSpark draft is
accepted exactly when it is the golden token at its position."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.decoding.dspark import DSpark

QUIET = ["engine.use_tqdm=false"]
PROMPTS = [[17, 99, 230, 5], [300, 12, 8, 41, 7]]
TEXT_PROMPTS = ["import os\n", "def main(argv):\n    "]


def test_golden_tokens_of_the_models_own_greedy_output_accept_every_draft_it_would_make():
    """The trained tiny model (its drafter agrees with it often): the same verify log as greedy."""
    llm = LLM("tiny", "reference", QUIET + ["decoding=dspark", "decoding.num_draft_tokens=3"])
    greedy = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    forced = llm.generate(TEXT_PROMPTS, [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        golden_token_ids=o.token_ids) for o in greedy])
    for g, f in zip(greedy, forced):
        assert f.token_ids == g.token_ids
        assert f.verify_log == g.verify_log and f.num_accepted == g.num_accepted > 0


def test_acceptance_against_another_text_matches_a_hand_count(monkeypatch):
    """Drafts are the golden continuation with the second draft wrong on every other verify step:
    such a step accepts 1 draft (emitting 2 tokens), the others accept both (3 tokens)."""
    golden = [(7 * i) % 400 + 20 for i in range(23)]
    original, step = DSpark.receive, {"n": 0}

    def drafts_from_golden(self, requests, drafted):
        original(self, requests, drafted)
        for request in (r for r in requests if r.drafts):
            at = len(request.output_token_ids)
            drafts = [golden[min(at + i, len(golden) - 1)] for i in range(self.k)]
            if step["n"] % 2:
                drafts[1] = drafts[1] + 1
            step["n"] += 1
            logprobs = torch.full((self.k, request.draft_logprobs.shape[1]), float("-inf"))
            logprobs[torch.arange(self.k), torch.tensor(drafts)] = 0.0
            request.drafts, request.draft_logprobs = drafts, logprobs

    monkeypatch.setattr(DSpark, "receive", drafts_from_golden)
    llm = LLM("tiny_random", "reference", QUIET + ["decoding=dspark", "decoding.num_draft_tokens=2"])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.7, seed=1, max_tokens=len(golden), ignore_eos=True,
                                                     golden_token_ids=golden))[0]
    assert out.token_ids == golden and out.finish_reason == "length"
    expected, emitted, n = [], 1, 0  # the prefill emits golden[0]; then each verify step in turn
    while emitted < len(golden):
        room = len(golden) - emitted
        verified = min(2, room - 1)
        accepted = min(verified, 1 if n % 2 else 2)
        expected.append((verified, accepted))
        emitted += accepted + 1
        n += 1
    assert [entry for entry in out.verify_log] == [e for e in expected if e[0] > 0]


def test_teacher_forcing_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="golden_token_ids must be a non-empty list"):
        SamplingParams(golden_token_ids=[])
    with pytest.raises(ValueError, match="cannot go with logprobs or structured"):
        SamplingParams(golden_token_ids=[3, 4], logprobs=2)
    llm = LLM("tiny_random", "reference", QUIET)
    with pytest.raises(ValueError, match="golden_token_ids holds 900, outside the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(golden_token_ids=[3, 900]))
