"""Drafts that force rejections: the true continuation with one token corrupted, the corrupted
position cycling through 0..k-1, so successive verify steps roll back at every depth."""
import torch

from deepinfer.decoding.dspark import DSpark


def force_rejections(monkeypatch, prompts, continuations, k: int, vocab: int = 500) -> dict:
    """Patch :meth:`DSpark.receive` so every request's drafts are its known greedy continuation
    (``continuations[i]`` for ``prompts[i]``) with one wrong token; returns the step counter."""
    truth = {tuple(p): list(p) + list(t) for p, t in zip(prompts, continuations)}
    original = DSpark.receive
    step = {"n": 0}

    def corrupted(self, requests, drafted):
        original(self, requests, drafted)
        for request in requests:
            if not request.drafts:
                continue
            full = truth[tuple(request.prompt_token_ids)]
            start = len(request.token_ids)
            drafts = [full[start + i] if start + i < len(full) else 3 for i in range(k)]
            wrong = step["n"] % k
            drafts[wrong] = (drafts[wrong] + 1) % vocab + 3
            request.drafts = drafts
            logprobs = torch.full((k, request.draft_logprobs.shape[1]), float("-inf"))
            logprobs[torch.arange(k), torch.tensor(drafts)] = 0.0
            request.draft_logprobs = logprobs
            step["n"] += 1

    monkeypatch.setattr(DSpark, "receive", corrupted)
    return step
