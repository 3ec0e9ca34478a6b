"""The vectorised id -> slot index against a dict doing the same operations."""

import numpy as np
import torch

from psserver.protocol.rows.index import IdIndex

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def test_index_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    g = torch.Generator().manual_seed(3)
    index, reference = IdIndex(), {}
    next_slot = 0
    for step in range(60):
        batch = torch.unique(torch.randint(-5000, 5000, (300,), generator=g))
        slots = index.find(batch)
        expected = torch.tensor([reference.get(i, -1) for i in batch.tolist()])
        assert torch.equal(slots, expected), f"step {step}"
        new = batch[slots < 0]
        new_slots = torch.arange(next_slot, next_slot + len(new))
        next_slot += len(new)
        index.insert(new, new_slots)
        reference.update(zip(new.tolist(), new_slots.tolist()))
        if step % 3 == 2:  # drop about half of what is held: tombstones, then rebuilds
            held = torch.tensor(sorted(reference))
            gone = held[torch.rand(len(held), generator=g) < 0.5]
            index.remove(gone)
            for i in gone.tolist():
                del reference[i]
        assert len(index) == len(reference)
        assert index.size + index.tombstones <= index.capacity // 2
    ids, slots = index.items()
    assert dict(zip(ids.tolist(), slots.tolist())) == reference


def test_ids_of_one_batch_with_the_same_home_position_all_get_their_own_place():
    index = IdIndex()
    # multiples of the smallest capacity: many share a home position and must probe past each other
    ids = torch.arange(0, 10_000, dtype=torch.int64) * 64
    index.insert(ids, torch.arange(10_000))
    assert torch.equal(index.find(ids), torch.arange(10_000))
    assert torch.equal(index.find(ids + 1), torch.full((10_000,), -1))


def test_extreme_ids_and_zero_are_ordinary_keys_and_absent_ones_read_minus_one():
    index = IdIndex()
    ids = torch.tensor([0, -1, INT64_MIN, INT64_MAX, 1 << 40])
    assert torch.equal(index.find(ids), torch.full((5,), -1))
    index.insert(ids, torch.tensor([10, 11, 12, 13, 14]))
    assert torch.equal(index.find(ids.flip(0)), torch.tensor([14, 13, 12, 11, 10]))
    index.remove(torch.tensor([INT64_MIN]))
    assert index.find(torch.tensor([INT64_MIN, INT64_MAX])).tolist() == [-1, 13]


def test_remove_answers_the_slot_each_id_had_and_minus_one_for_ids_not_held():
    index = IdIndex()
    index.insert(torch.tensor([5, 7, 9]), torch.tensor([0, 1, 2]))
    assert index.remove(torch.tensor([7, 8, 5])).tolist() == [1, -1, 0]
    assert len(index) == 1 and index.find(torch.tensor([5, 7, 9])).tolist() == [-1, -1, 2]


def test_inserts_at_the_room_a_find_saw_agree_with_a_dict_through_removals_and_rebuilds():
    """find_with_room + insert(room) (one probe pass, issue 21 item 2): the same answers as the dict, a subset of
    the missing ids inserted as the row store's admission does, removals and rebuilds between."""
    g = torch.Generator().manual_seed(5)
    index, reference, next_slot = IdIndex(), {}, 0
    for step in range(60):
        batch = torch.unique(torch.randint(-5000, 5000, (300,), generator=g))
        slots, room = index.find_with_room(batch)
        assert torch.equal(slots, torch.tensor([reference.get(i, -1) for i in batch.tolist()])), f"step {step}"
        missing = (slots < 0).nonzero().flatten()
        admitted = missing[torch.rand(len(missing), generator=g) < 0.8]
        new_slots = torch.arange(next_slot, next_slot + len(admitted))
        next_slot += len(admitted)
        index.insert(batch[admitted], new_slots, room.of(admitted))
        reference.update(zip(batch[admitted].tolist(), new_slots.tolist()))
        if step % 3 == 2:
            held = torch.tensor(sorted(reference))
            gone = held[torch.rand(len(held), generator=g) < 0.5]
            index.remove(gone)
            for i in gone.tolist():
                del reference[i]
        assert len(index) == len(reference)
    ids, slots = index.items()
    assert dict(zip(ids.tolist(), slots.tolist())) == reference


def test_a_room_seen_before_another_insert_is_not_used_and_no_key_is_overwritten():
    """a's room points at the empty positions b's insert takes since (a and b share home positions); a's insert
    must probe again, not overwrite b's keys."""
    index = IdIndex(capacity=4096)  # no rebuild below: only the inserts change it
    index.insert(torch.tensor([-1]), torch.tensor([0]))  # not empty: the probing path
    candidates = np.arange(1, 200_000, dtype=np.int64)
    home = index._home(candidates)
    first, pos = np.unique(home, return_index=True)
    a = torch.from_numpy(candidates[pos[:40]])
    taken = np.isin(home, first[:40])
    taken[pos[:40]] = False
    b = torch.from_numpy(candidates[taken][:40])  # homes among a's
    _, room = index.find_with_room(a)
    index.insert(b, torch.arange(100, 100 + len(b)))
    index.insert(a, torch.arange(1, 41), room)
    assert torch.equal(index.find(a), torch.arange(1, 41))
    assert torch.equal(index.find(b), torch.arange(100, 100 + len(b)))
    assert len(index) == 81
