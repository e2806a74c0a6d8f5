"""Allowed-token masks of one step's logits rows: the grammars' (:func:`~deepinfer.decoding.structured.
step_bitmasks`) and the tokens a request bans, ``SamplingParams.banned_token_ids`` always and its
end tokens (EOS and ``stop_token_ids``) before ``min_tokens`` outputs."""
from __future__ import annotations

import numpy as np
import torch

from deepinfer.decoding.structured import step_bitmasks
from deepinfer.hal.ops.token_bitmask import bitmask_words


def banned_tokens(chunk, eos_token_ids) -> list[set[int]]:
    """Per logits row of ``chunk`` (each verified draft, then the final row) the tokens it may not
    emit: row ``j`` emits output token ``len(outputs) + j`` (no step of the request in flight)."""
    params, emitted = chunk.request.params, len(chunk.request.output_token_ids)
    ends = set(eos_token_ids) | set(params.stop_token_ids)
    return [set(params.banned_token_ids) | (ends if emitted + j < params.min_tokens else set())
            for j in range(len(chunk.drafts) + 1)]


def step_masks(chunks, vocab_size: int, eos_token_ids) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bitmask int32 [M, ceil(V/32)], rows int64 [M])`` over the logits rows of ``chunks`` (as
    :func:`~deepinfer.hal.ops.token_bitmask.apply_token_bitmask` takes them), or None when no row
    is constrained: a grammar's mask with each row's banned tokens cleared."""
    grammar = step_bitmasks(chunks, vocab_size)
    bans, row = {}, 0
    for chunk in chunks:
        for j, tokens in enumerate(banned_tokens(chunk, eos_token_ids)):
            if tokens:
                bans[row + j] = tokens
        row += len(chunk.drafts) + 1
    if not bans:
        return grammar
    known = {} if grammar is None else {int(r): i for i, r in enumerate(grammar[1].tolist())}
    rows = sorted(set(known) | set(bans))
    bitmask = np.full((len(rows), bitmask_words(vocab_size)), 0xFFFFFFFF, dtype=np.uint32)
    for i, r in enumerate(rows):
        if r in known:
            bitmask[i] = grammar[0][known[r]].numpy().view(np.uint32)
        for token in bans.get(r, ()):
            if token < vocab_size:
                bitmask[i, token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
    return torch.from_numpy(bitmask.view(np.int32)), torch.tensor(rows, dtype=torch.int64)
