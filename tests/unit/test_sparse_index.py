"""The vectorised id -> slot index against a dict doing the same operations."""

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
