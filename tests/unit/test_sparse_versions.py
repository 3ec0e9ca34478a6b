"""RowVersions: each row's last-update version kept beside its slot (psserver.sparse.versions)."""

from __future__ import annotations

import torch

from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import RowStore, TableSpec
from psserver.sparse.versions import RowVersions

DIM = 4


def as_dict(versions: RowVersions) -> dict[int, int]:
    """The map as a checkpoint saves it (RowVersions.saved), read as id -> version."""
    saved = versions.saved()
    return dict(zip(saved["ids"].tolist(), saved["versions"].tolist()))


def store_with(ids: list[int], max_rows: int | None = None) -> RowStore:
    store = RowStore(TableSpec("t", DIM, optimizer=SparseOptimizerConfig("sgd", lr=0.1), max_rows=max_rows))
    store.lookup(torch.tensor(ids))
    return store


def test_an_update_is_read_back_per_id_and_rows_never_updated_read_minus_one():
    store = store_with([3, 5, 9])
    versions = RowVersions(store)
    ids = torch.tensor([3, 9])
    versions.set(ids, store.apply(ids, torch.ones(2, DIM)), 7)
    assert versions.get(torch.tensor([3, 5, 9, 11])).tolist() == [7, -1, 7, -1]
    assert as_dict(versions) == {3: 7, 9: 7} and len(versions) == 2


def test_a_slot_freed_by_eviction_and_taken_by_a_new_row_reads_as_never_updated():
    store = store_with([1, 2], max_rows=2)
    versions = RowVersions(store)
    one = torch.tensor([1])
    versions.set(one, store.apply(one, torch.ones(1, DIM)), 4)
    store.lookup(torch.tensor([2]))
    store.lookup(torch.tensor([8]))  # evicts row 1 (least recently used); row 8 takes its slot
    assert not bool(store.holds(one)[0])
    assert versions.get(torch.tensor([1, 8])).tolist() == [-1, -1]
    assert len(versions) == 0


def test_ungated_gradients_of_ids_not_admitted_record_no_update():
    store = RowStore(TableSpec("t", DIM, admit_after=1))
    versions = RowVersions(store)
    ids = torch.tensor([6])
    versions.set(ids, store.apply(ids, torch.ones(1, DIM)), 1)  # id 6 never looked up: not admitted
    assert versions.get(ids).tolist() == [-1]


def test_a_checkpoint_dict_restores_the_same_versions_and_drops_rows_the_store_does_not_hold():
    store = store_with([3, 5, 9])
    versions = RowVersions(store)
    versions.restore({3: 2, 9: 5, 40: 1})
    assert as_dict(versions) == {3: 2, 9: 5}
