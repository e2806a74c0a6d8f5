"""SWA ring ops against per-row Python oracles, hand-worked examples and a ring/prefill agreement test."""
import pytest
import torch

from deepinfer.hal.ops.kv_cache import kv_load, kv_store
from deepinfer.hal.ops.swa_replay import (
    swa_decode_indices,
    swa_history_slots,
    swa_prefill_indices,
    swa_ring_slots,
)
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle


def ring_row(slot, position, ring_size):
    if slot == -1 or position < 0:
        return -1
    return slot * ring_size + position % ring_size


def visible_keys(position, window, first_visible):
    """(key position, visible?) for the query's window, ascending."""
    return [(kp, kp >= max(0, first_visible)) for kp in range(position - window + 1, position + 1)]


def swa_ring_slots_oracle(state_slots, positions, ring_size):
    return torch.tensor([ring_row(s, p, ring_size) for s, p in zip(state_slots.tolist(), positions.tolist())])


def swa_decode_indices_oracle(state_slots, positions, window, ring_size, visible_start=None):
    starts = visible_start.tolist() if visible_start is not None else [0] * len(positions)
    rows = [[ring_row(s, kp, ring_size) if seen else -1 for kp, seen in visible_keys(p, window, v)]
            for s, p, v in zip(state_slots.tolist(), positions.tolist(), starts)]
    return torch.tensor(rows, dtype=torch.int32)


def swa_prefill_indices_oracle(positions, chunk_start, history_offset, chunk_offset, window,
                               visible_start=None):
    starts = visible_start.tolist() if visible_start is not None else [0] * len(positions)
    rows = []
    for p, c, h, o, v in zip(positions.tolist(), chunk_start.tolist(), history_offset.tolist(),
                             chunk_offset.tolist(), starts):
        history = {c - window + 1 + i: h + i for i in range(window - 1)}
        chunk = {c + j: o + j for j in range(p - c + 1)}
        rows.append([{**history, **chunk}[kp] if seen else -1 for kp, seen in visible_keys(p, window, v)])
    return torch.tensor(rows, dtype=torch.int32)


def swa_history_slots_oracle(state_slots, chunk_start, window, ring_size):
    return torch.tensor([[ring_row(s, c - window + 1 + i, ring_size) for i in range(window - 1)]
                         for s, c in zip(state_slots.tolist(), chunk_start.tolist())])


ORACLES = {
    "swa_ring_slots": swa_ring_slots_oracle,
    "swa_decode_indices": swa_decode_indices_oracle,
    "swa_prefill_indices": swa_prefill_indices_oracle,
    "swa_history_slots": swa_history_slots_oracle,
}


@pytest.mark.parametrize("op,case", [(op, c.name) for op in ORACLES for c in SPECS[op].cases])
def test_matches_oracle(op, case):
    check_against_oracle(op, case, ORACLES[op])


def t(*values):
    return torch.tensor(values)


def test_hand_worked_ring_slots():
    # ring 6: slot 2 owns rows 12..17; position 13 -> 12 + 1; slot -1 and position -1 are padding
    assert swa_ring_slots(t(2, 2, 0, -1, 1), t(13, 5, 6, 9, -1), 6).tolist() == [13, 17, 0, -1, -1]


def test_hand_worked_decode_indices():
    # window 4, ring 6, state slot 1 (rows 6..11)
    got = swa_decode_indices(t(1, 1, 1), t(1, 7, 9), window=4, ring_size=6)
    assert got.dtype == torch.int32
    assert got.tolist() == [
        [-1, -1, 6, 7],     # keys -2, -1, 0, 1: negative positions are padding
        [10, 11, 6, 7],     # keys 4, 5, 6, 7 wrap around the ring
        [6, 7, 8, 9],       # keys 6, 7, 8, 9
    ]
    padding_row = swa_decode_indices(t(-1), t(9), window=4, ring_size=6)
    assert padding_row.tolist() == [[-1, -1, -1, -1]]


def test_hand_worked_prefill_indices():
    # window 4, chunk starts at 5: history keys 2, 3, 4 at rows 10, 11, 12; chunk key 5 + j at row 20 + j
    got = swa_prefill_indices(t(5, 6, 9), t(5, 5, 5), t(10, 10, 10), t(20, 20, 20), window=4)
    assert got.tolist() == [[10, 11, 12, 20], [11, 12, 20, 21], [21, 22, 23, 24]]


def test_hand_worked_history_slots():
    # window 4, ring 6; chunk at 7 needs keys 4, 5, 6; chunk at 1 needs keys -2, -1, 0
    assert swa_history_slots(t(1, 0), t(7, 1), window=4, ring_size=6).tolist() == [[10, 11, 6], [-1, -1, 0]]


def test_bounded_replay_visibility():
    # prompt of 10 tokens, KEEP 6: kept queries 4..9 see keys from position 4 on
    positions = torch.arange(4, 10)
    visible_start = torch.full((6,), 4)
    got = swa_decode_indices(torch.zeros(6, dtype=torch.int64), positions, 4, 6, visible_start)
    assert got.tolist() == [[-1, -1, -1, 4], [-1, -1, 4, 5], [-1, 4, 5, 0], [4, 5, 0, 1], [5, 0, 1, 2],
                            [0, 1, 2, 3]]
    before_the_suffix = swa_decode_indices(t(0), t(3), 4, 6, t(4))
    assert before_the_suffix.tolist() == [[-1, -1, -1, -1]]
    prefill = swa_prefill_indices(positions, torch.full((6,), 4), torch.zeros(6, dtype=torch.int64),
                                  torch.full((6,), 3), 4, visible_start)
    assert prefill.tolist() == [[-1, -1, -1, 3], [-1, -1, 3, 4], [-1, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7],
                                [5, 6, 7, 8]]


def key_rows(positions):
    """index_bf16 key rows holding their own position + 1 (so an empty row reads as position -1)."""
    return (positions.float() + 1).unsqueeze(1).expand(-1, 128)


def positions_of(rows):
    return rows[..., 0].round().long() - 1


@pytest.mark.parametrize("window,ring_size,chunk_len", [(4, 6, 3), (4, 4, 1), (8, 11, 4)])
def test_prefill_buffer_and_decode_ring_read_the_same_keys(window, ring_size, chunk_len):
    """Keys hold their own position. Prefill reads [history | chunk] gathered before the chunk is
    stored; decode reads the ring after it is stored; both must see the same key positions."""
    state_slots, chunk_start = t(2, 0, 1), t(0, 3, 13)
    ring = torch.zeros(3, ring_size, 256, dtype=torch.uint8)
    for slot, start in zip(state_slots.tolist(), chunk_start.tolist()):
        earlier = torch.arange(max(0, start - ring_size), start)
        kv_store(ring, swa_ring_slots(torch.full_like(earlier, slot), earlier, ring_size), key_rows(earlier),
                 "index_bf16")
    history_slots = swa_history_slots(state_slots, chunk_start, window, ring_size)
    history = kv_load(ring, history_slots.flatten(), "index_bf16")
    owner = torch.arange(3).repeat_interleave(chunk_len)
    positions = chunk_start[owner] + torch.arange(chunk_len).repeat(3)
    buffer = torch.cat((history, key_rows(positions)))
    visible_start = positions - t(9, 2, 0, 9, 1, 9, 3, 9, 0, 9, 2, 9)[:len(positions)]
    prefill = swa_prefill_indices(positions, chunk_start[owner], owner * (window - 1),
                                  3 * (window - 1) + owner * chunk_len, window, visible_start)

    chunk_slots = swa_ring_slots(state_slots[owner], positions, ring_size)
    kv_store(ring, chunk_slots, key_rows(positions), "index_bf16")
    decode = swa_decode_indices(state_slots[owner], positions, window, ring_size, visible_start)

    seen = prefill >= 0
    assert torch.equal(seen, decode >= 0)
    from_ring = positions_of(kv_load(ring, decode.flatten().long(), "index_bf16")).reshape(decode.shape)
    from_buffer = positions_of(buffer[prefill.clamp(min=0).long()])
    wanted = positions.unsqueeze(1) + torch.arange(1 - window, 1)
    assert torch.equal(from_buffer[seen], wanted[seen]) and torch.equal(from_ring[seen], wanted[seen])
    assert torch.equal(seen, wanted >= visible_start.clamp(min=0).unsqueeze(1))


@pytest.mark.parametrize("call,match", [
    (lambda: swa_ring_slots(t(1), t(1, 2), 6), "one length"),
    (lambda: swa_ring_slots(t(1).int(), t(1), 6), "state_slots must be an int64 vector"),
    (lambda: swa_ring_slots(t(1), t(1), 0), "ring_size must be a positive int, got 0"),
    (lambda: swa_decode_indices(t(1), t(1), 7, 6), "window 7 does not fit the ring of 6 rows"),
    (lambda: swa_history_slots(t(1), t(1), 7, 6), "window 7 does not fit"),
    (lambda: swa_prefill_indices(t(3), t(4), t(0), t(3), 4), r"row 0 has position 3 < chunk_start 4"),
    (lambda: swa_decode_indices(t(1), t(1), 4, 6, t(0, 0)), "one length"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()
