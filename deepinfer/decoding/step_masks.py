"""Allowed-token masks of one step's logits rows: the grammars' (:func:`~deepinfer.decoding.structured.
step_bitmasks`), the tokens a request bans (``SamplingParams.banned_token_ids`` always, its end
tokens, EOS and ``stop_token_ids``, before ``min_tokens`` outputs), and teacher forcing
(``golden_token_ids``: each row allows its golden token alone, so sampling emits it and a draft
is accepted exactly when it equals it)."""
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


def golden_tokens(chunk) -> list[int | None]:
    """Per logits row of ``chunk`` the one token it may emit under teacher forcing (None: any)."""
    golden, emitted = chunk.request.params.golden_token_ids, len(chunk.request.output_token_ids)
    rows = len(chunk.drafts) + 1
    if golden is None:
        return [None] * rows
    return [golden[emitted + j] if emitted + j < len(golden) else None for j in range(rows)]


def step_masks(chunks, vocab_size: int, eos_token_ids) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bitmask int32 [M, ceil(V/32)], rows int64 [M])`` over the logits rows of ``chunks`` (as
    :func:`~deepinfer.hal.ops.token_bitmask.apply_token_bitmask` takes them), or None when no row
    is constrained: a grammar's mask with each row's banned tokens cleared."""
    grammar = step_bitmasks(chunks, vocab_size)
    bans, forced, row = {}, {}, 0
    for chunk in chunks:
        for j, (tokens, golden) in enumerate(zip(banned_tokens(chunk, eos_token_ids), golden_tokens(chunk))):
            if tokens:
                bans[row + j] = tokens
            if golden is not None:
                forced[row + j] = golden
        row += len(chunk.drafts) + 1
    if not bans and not forced:
        return grammar
    known = {} if grammar is None else {int(r): i for i, r in enumerate(grammar[1].tolist())}
    rows = sorted(set(known) | set(bans) | set(forced))
    bitmask = np.full((len(rows), bitmask_words(vocab_size)), 0xFFFFFFFF, dtype=np.uint32)
    for i, r in enumerate(rows):
        if r in forced:
            bitmask[i] = 0
            bitmask[i, forced[r] // 32] = np.uint32(1 << (forced[r] % 32))
            continue
        if r in known:
            bitmask[i] = grammar[0][known[r]].numpy().view(np.uint32)
        for token in bans.get(r, ()):
            if token < vocab_size:
                bitmask[i, token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
    return torch.from_numpy(bitmask.view(np.int32)), torch.tensor(rows, dtype=torch.int64)
