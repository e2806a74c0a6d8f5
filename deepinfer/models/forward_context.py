"""ForwardContext: everything one model forward needs to know about the batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """Per-step metadata of a packed batch (the tokens of each sequence are contiguous).

    ``positions`` are absolute positions inside each sequence; ``context_lens[b]`` is the number
    of tokens sequence ``b`` holds after this step; ``block_tables[b]`` lists its paged-cache
    blocks (-1 padding); ``state_slots[b]`` is its SWA-ring / compress-state slot.
    ``logits_indices`` selects the token rows whose logits are returned. ``decode`` asks for the
    quantized-cache decode path (every sequence then has the same number of query tokens).
    ``write_draft_cache``: the target forward also writes the DSpark draft layers' main keys.
    ``draft_block`` > 0 marks a DSpark draft pass: each sequence's rows are one block that
    attends bidirectionally to itself and to the ``window`` keys before it.
    ``replay_start`` (SWA bounded replay; None: off) is ``int64 [B]``, the first position of
    each sequence the YOCO consumer layers process and see; ``replay_compact`` computes only
    those rows there (plus each chunk's last row) instead of masking (see ``bounded_replay``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    decode: bool = False
    write_draft_cache: bool = False
    draft_block: int = 0
    replay_start: torch.Tensor | None = None
    replay_compact: bool = False

    def __post_init__(self) -> None:
        lens = self.query_lens.long()
        self.num_seqs = int(lens.numel())
        self.seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=lens.device), lens)
        self.query_start = torch.cat((lens.new_zeros(1), lens.cumsum(0)))
        self.chunk_start = (self.context_lens.long() - lens)
        self.chunk_start_of_token = self.chunk_start[self.seq_of_token]
        self.slot_of_token = self.state_slots.long()[self.seq_of_token]
        if int(lens.sum()) != self.input_ids.numel():
            raise ValueError(f"query_lens sum to {int(lens.sum())} but there are {self.input_ids.numel()} tokens")
        if self.decode and self.num_seqs and not bool((lens == lens[0]).all()):
            raise ValueError(f"the decode path needs equal query lengths per sequence, got {lens.tolist()}")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def decode_query_len(self) -> int:
        return int(self.query_lens[0]) if self.num_seqs else 0

    @classmethod
    def for_sequences(cls, token_chunks: list[list[int]], start_positions: list[int], state_slots: list[int],
                      block_tables: list[list[int]], decode: bool = False, all_logits: bool = False,
                      device: torch.device | str = "cpu") -> "ForwardContext":
        """Build a context from plain lists (one entry per sequence); the last token of each
        sequence gets logits unless ``all_logits``."""
        ids = [t for chunk in token_chunks for t in chunk]
        positions = [s + i for chunk, s in zip(token_chunks, start_positions) for i in range(len(chunk))]
        lens = [len(c) for c in token_chunks]
        width = max((len(b) for b in block_tables), default=0)
        table = [b + [-1] * (width - len(b)) for b in block_tables]
        ends = torch.tensor(lens).cumsum(0) - 1
        logits = torch.arange(len(ids)) if all_logits else ends
        as_long = dict(dtype=torch.long, device=device)
        return cls(
            input_ids=torch.tensor(ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            query_lens=torch.tensor(lens, **as_long),
            context_lens=torch.tensor([s + n for s, n in zip(start_positions, lens)], **as_long),
            state_slots=torch.tensor(state_slots, **as_long),
            block_tables=torch.tensor(table, **as_long).reshape(len(lens), width),
            logits_indices=logits.to(device),
            decode=decode,
        )
