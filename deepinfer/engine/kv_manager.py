"""Cache resources: paged blocks of the model's ``page_tokens`` tokens and per-sequence state slots
(for DeepSeek-V4.1: compressed KV and index K in blocks of 128 tokens; SWA rings and compress
state in slots). Block 0 and slot 0 are never handed out (padding)."""
from __future__ import annotations

import math
from collections import deque

from deepinfer.engine.request import Request


class KVManager:
    """Hands out blocks (free list: pop front, push back) and state slots to requests."""

    def __init__(self, num_blocks: int, num_state_slots: int, block_tokens: int):
        if num_blocks < 2 or num_state_slots < 2:
            raise ValueError(f"need at least 2 blocks and 2 state slots (index 0 is padding), got "
                             f"{num_blocks} and {num_state_slots}")
        self.num_blocks, self.num_state_slots, self.block_tokens = num_blocks, num_state_slots, block_tokens
        self.free_blocks = deque(range(1, num_blocks))
        self.free_slots = deque(range(1, num_state_slots))

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_tokens)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new request holding ``num_tokens`` tokens would fit now."""
        return bool(self.free_slots) and self.blocks_for(num_tokens) <= len(self.free_blocks)

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Give ``request`` a state slot and enough blocks for ``num_tokens``; False (and no
        change) when there are not enough free resources."""
        extra = self.blocks_for(num_tokens) - len(request.blocks)
        needs_slot = request.state_slot is None
        if extra > len(self.free_blocks) or (needs_slot and not self.free_slots):
            return False
        if needs_slot:
            request.state_slot = self.free_slots.popleft()
        request.blocks.extend(self.free_blocks.popleft() for _ in range(max(0, extra)))
        return True

    def release(self, request: Request) -> None:
        """Return the request's blocks and state slot."""
        self.free_blocks.extend(request.blocks)
        request.blocks = []
        if request.state_slot is not None:
            self.free_slots.append(request.state_slot)
            request.state_slot = None

    @property
    def usage(self) -> float:
        return 1 - len(self.free_blocks) / (self.num_blocks - 1)
