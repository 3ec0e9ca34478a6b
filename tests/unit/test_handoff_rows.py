"""The pure row copy, forward and replay of a live re-shard (psserver.resharding.handoff.rows): the forwarded rows of each
closed round replayed onto the copy equal the source's rows at R bit for bit (SGD, Adagrad, Adam), rows created in
a round included, evicted rows forwarded as deletions, and the destination's assembly equals restore's re-cut."""

import pytest
import torch

from psserver.protocol.errors import NotReady
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import RowStore, TableSpec
from psserver.resharding.handoff.rows import (ROW_FIELDS, RowDelta, RowImage, RowLog, TableTracker, assemble, rows_digest, split,
                                   split_ids, table_rows)
from psserver.resharding.reshard import recut_table
from psserver.sparse.serving import Membership

M2 = 3  # 2 -> 3 shards: the destinations


def store_of(optimizer="adagrad", **kw) -> RowStore:
    return RowStore(TableSpec("emb", 4, optimizer=SparseOptimizerConfig(optimizer, lr=0.1), seed=3, **kw))


def a_round(store: RowStore, gen: torch.Generator, high=400, n=40) -> None:
    """A round as a shard sees it: a lookup (creates the new ids' rows), then one apply of the round's average."""
    ids = torch.unique(torch.randint(0, high, (n,), generator=gen))
    store.lookup(ids)
    store.apply(ids, torch.randn(len(ids), 4, generator=gen))


def assert_rows_equal(got: dict, want: dict) -> None:
    for k in ROW_FIELDS:
        assert torch.equal(got[k], want[k]), k


class Handoff:
    """One source's rows copied at PREPARE and forwarded each round to M2 destination images."""

    def __init__(self, store: RowStore, version=0):
        self.store, self.version = store, version
        self.tracker = TableTracker(store)
        self.images = [RowImage(version, rows) for rows in split(table_rows(store), M2)]

    def close_round(self) -> None:
        self.version += 1
        rows, deleted = self.tracker.take()
        for image, r, d in zip(self.images, split(rows, M2), split_ids(deleted, M2)):
            assert image.forward(RowDelta(self.version, r, d))

    def vote(self) -> None:
        """The final forward at the vote (rows read since the last round), then every image equals its rows."""
        rows, deleted = self.tracker.peek()
        for image, r, d, want in zip(self.images, split(rows, M2), split_ids(deleted, M2),
                                     split(table_rows(self.store), M2)):
            image.apply(r, d)
            assert_rows_equal(image.rows, want)
            assert rows_digest(image.rows, "v") == rows_digest(want, "v")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_forwarded_dirty_rows_replayed_onto_the_copy_equal_the_source_rows_at_r_bit_for_bit(optimizer):
    gen = torch.Generator().manual_seed(1)
    store = store_of(optimizer)
    for _ in range(3):
        a_round(store, gen)
    h = Handoff(store, version=3)
    for _ in range(6):  # every round creates rows too (ids up to 400, 40 a round)
        a_round(store, gen)
        h.close_round()
    store.lookup(torch.tensor([7, 1000, 1001]))  # read after the last round: two rows created
    h.vote()
    assert sum(len(i.rows["ids"]) for i in h.images) == len(store)


def test_rows_created_after_the_copy_reach_only_their_new_owner():
    store = store_of()
    h = Handoff(store)
    store.lookup(torch.arange(30))
    store.apply(torch.arange(30), torch.ones(30, 4))
    h.close_round()
    for d, image in enumerate(h.images):
        ids = image.rows["ids"]
        assert len(ids) and torch.equal(split_ids(ids, M2)[d], ids)
    assert torch.equal(torch.sort(torch.cat([i.rows["ids"] for i in h.images])).values, torch.arange(30))


@pytest.mark.parametrize("evict", [dict(max_rows=64), dict(evict_after=2)], ids=["lru", "stale"])
def test_rows_evicted_at_the_source_are_forwarded_as_deletions(evict):
    gen = torch.Generator().manual_seed(2)
    store = store_of(**evict)
    for _ in range(2):
        a_round(store, gen)
    h = Handoff(store, version=2)
    for _ in range(6):
        a_round(store, gen)
        h.close_round()
    counts = store.counts
    assert counts.evicted_lru + counts.evicted_stale > 0
    h.vote()


def test_a_forward_repeated_is_acknowledged_not_applied_and_a_gap_is_refused_changing_nothing():
    store = store_of()
    h = Handoff(store, version=5)
    store.lookup(torch.arange(10))
    rows, deleted = h.tracker.take()
    delta = RowDelta(6, split(rows, M2)[0], split_ids(deleted, M2)[0])
    image = h.images[0]
    assert image.forward(delta) and not image.forward(delta)
    before = {k: v.clone() for k, v in image.rows.items()}
    with pytest.raises(NotReady, match="forward version is 8 but the rows here are at version 6"):
        image.forward(RowDelta(8, split(rows, M2)[0], deleted))
    assert_rows_equal(image.rows, before)


def test_a_row_log_past_its_bound_asks_for_a_copy_and_an_ack_lets_rounds_go():
    log = RowLog(max_lag=2)
    empty = {k: torch.empty(0) for k in ROW_FIELDS}
    assert log.record(RowDelta(1, empty, torch.empty(0))) and log.record(RowDelta(2, empty, torch.empty(0)))
    assert not log.record(RowDelta(3, empty, torch.empty(0)))
    log.ack(1)
    assert [e.version for e in log.entries] == [2]


def test_a_changed_row_changes_the_digest_so_a_vote_can_fail():
    store = store_of()
    store.lookup(torch.arange(20))
    rows = table_rows(store)
    changed = {k: v.clone() for k, v in rows.items()}
    changed["optimizer_state"][3, 0] += 1e-7
    assert rows_digest(rows, "v=1") != rows_digest(changed, "v=1")
    assert rows_digest(rows, "v=1") != rows_digest(rows, "v=2")


def test_the_assembled_table_of_every_source_equals_restores_recut_of_their_states():
    gen = torch.Generator().manual_seed(4)
    spec = TableSpec("emb", 4, optimizer=SparseOptimizerConfig("adagrad", lr=0.1), seed=3, admit_after=1)
    old = [RowStore(spec), RowStore(spec)]
    for _ in range(4):
        for i, s in enumerate(old):
            ids = split_ids(torch.unique(torch.randint(0, 300, (60,), generator=gen)), 2)[i]  # old shard i's
            s.lookup(ids)
            s.lookup(ids)  # seen twice: admitted
            s.apply(ids, torch.randn(len(ids), 4, generator=gen))
    saved = [dict(rows=s.state(), version=4, round=None, updated_at={}, acked={}) for s in old]
    for d in range(M2):
        parts = [(RowImage(4, split(table_rows(s), M2)[d]),
                  dict(store_version=s.version, tick=s.tick, sketch=s.sketch.counts.clone(),
                       sightings=s.sketch.sightings)) for s in old]
        got, want = assemble(parts, 4), recut_table(saved, M2, d)
        for k in (*ROW_FIELDS, "sketch"):
            assert torch.equal(got["rows"][k], want["rows"][k]), k
        assert {k: got["rows"][k] for k in ("version", "tick", "sketch_sightings")} == {
            k: want["rows"][k] for k in ("version", "tick", "sketch_sightings")}
        restored = RowStore.restore(spec, got["rows"])  # the new shard restores it as restore does
        assert len(restored) == len(got["rows"]["ids"])


def test_assembly_refuses_sources_at_different_versions_naming_them():
    store = store_of()
    parts = [(RowImage(v, split(table_rows(store), M2)[0]), dict(store_version=0, tick=0, sketch=None, sightings=0))
             for v in (4, 5)]
    with pytest.raises(NotReady, match=r"versions \[4, 5\].*every source at 5"):
        assemble(parts, 5)


def test_a_sync_tables_round_is_held_from_the_hand_offs_hold_as_the_dense_round_is():
    members = Membership(frozenset({0}), True, None, handoff_held_from=5)
    assert [members.at(r)[2] for r in (4, 5, 6)] == [False, True, True]
    assert not Membership(frozenset({0}), True, None).at(5)[2]
