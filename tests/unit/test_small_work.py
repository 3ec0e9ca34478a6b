"""Where a row call's table work runs (psserver.sparse.calls, ServedTable.small_work, RowStore.room_for): on the
event loop when what *this call* can do is small -- its rows, the round it may close, no pass over the whole
table -- and on the state worker when it may grow the store or its index, evict, or scan.  No network, no threads:
a fake runtime records where each call went."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.rows.index import IdIndex
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.sparse.calls import INLINE_ROW_ELEMENTS, RowCalls
from psserver.sparse.serving import Membership, RowsPush, ServedTable

DIM = 16
LIMIT = INLINE_ROW_ELEMENTS  # 4,096 rows of dim 16
BIG = 5000  # rows: past LIMIT // DIM, so the table's own size no longer decides


def table(mode: str = "sync", num_trainers: int = 1, **spec) -> ServedTable:
    s = TableSpec("t", DIM, optimizer=SparseOptimizerConfig("adagrad", lr=0.1), **spec)
    j = JobSpec(mode=mode, num_trainers=num_trainers, num_shards=1, total_params=0, fingerprint="f", tables=(s,))
    return ServedTable(s, j)


def big(t: ServedTable, rows: int = BIG) -> ServedTable:
    """``t`` holding ``rows`` rows, its slots exactly full (a store grows to what a call needs past doubling)."""
    t.store.lookup(torch.arange(rows))
    assert t.store.capacity == rows and t.store.capacity * DIM > LIMIT
    return t


def roomy(t: ServedTable) -> ServedTable:
    """A big ``t`` that just grew: room for as many rows again."""
    big(t).store.lookup(torch.arange(BIG, BIG + 100))
    assert t.store.capacity >= 2 * BIG
    return t


class FakeRuntime:
    """Where RowCalls sends work: ``inline`` (run_state on the loop, the dense slice small) or ``offload``."""

    def __init__(self):
        self.went: list[str] = []

    def inline(self) -> bool:
        return True

    def run_state(self, fn, *args):
        self.went.append("loop")
        return fn(*args)

    def offload(self, fn, *args):
        self.went.append("worker")
        return fn(*args)


def test_a_call_on_a_big_table_that_cannot_grow_it_stays_on_the_event_loop():
    t = roomy(table())
    assert t.small_work(700 * DIM, LIMIT)  # a click step's part: 700 rows, the store has room for ~4,900 more


def test_a_call_whose_new_rows_could_grow_a_big_table_goes_to_the_state_worker_and_would_have_grown_it():
    t = big(table())
    assert not t.small_work(DIM, LIMIT)  # one more row: the slots are full, a growth copies all 5,000
    capacity = t.store.capacity
    t.store.lookup(torch.tensor([BIG]))
    assert t.store.capacity > capacity  # what the answer guarded against


def test_room_for_counts_every_id_as_new_without_a_find_so_a_call_near_capacity_is_answered_no():
    t = roomy(table())
    left = t.store.capacity - len(t.store)
    assert t.store.room_for(left) and not t.store.room_for(left + 1)


def test_a_call_that_would_rebuild_the_id_index_is_not_small_even_with_free_slots():
    index = IdIndex()
    index.insert(torch.arange(10), torch.arange(10))
    room = int(index.capacity * 0.5) - 10
    assert not index.rebuilds_for(room) and index.rebuilds_for(room + 1)
    before = index.capacity
    index.insert(torch.arange(10, 11 + room), torch.arange(10, 11 + room))
    assert index.capacity > before  # insert's own test: the same answer


def test_a_call_that_could_evict_least_recently_used_rows_of_a_big_table_goes_to_the_state_worker():
    t = big(table(max_rows=BIG))
    assert t.store.room_for(0) and not t.store.room_for(1)
    assert not t.small_work(DIM, LIMIT)


def test_a_big_table_that_evicts_stale_rows_scans_at_every_update_so_its_calls_go_to_the_state_worker():
    t = roomy(table(evict_after=10))
    assert t.store.room_for(100)
    assert not t.small_work(DIM, LIMIT)


def test_a_big_table_under_a_live_reshard_scans_at_each_round_close_so_its_calls_go_to_the_state_worker():
    t = roomy(table())
    assert t.small_work(DIM, LIMIT)
    t.round_listener = lambda *_: None
    assert not t.small_work(DIM, LIMIT)


def test_a_push_that_may_close_a_round_over_a_large_union_of_ids_goes_to_the_state_worker():
    t = roomy(table(num_trainers=2))
    ids = torch.arange(3000)
    t.push(RowsPush(0, "t0", 0, 1, 1, ids, torch.ones(3000, DIM)), Membership(frozenset({0, 1})), now=0.0)
    assert len(t.round.ids) == 3000
    assert not t.small_work(2000 * DIM, LIMIT)  # 3,000 + 2,000 rows in the union: over 4,096
    assert t.small_work(500 * DIM, LIMIT)


def test_the_calls_own_rows_over_the_bound_go_to_the_state_worker_on_a_table_of_any_size():
    assert not table().small_work(LIMIT + DIM, LIMIT)
    assert not roomy(table()).small_work(LIMIT + DIM, LIMIT)


def test_a_small_table_stays_on_the_event_loop_whatever_the_call_creates():
    t = table()
    assert t.store.capacity * DIM <= LIMIT and t.small_work(2000 * DIM, LIMIT)


def test_an_async_table_with_a_staleness_bound_goes_to_the_worker_while_its_update_map_could_grow():
    t = roomy(table(mode="async", max_staleness=2))
    members = Membership(frozenset({0}))
    assert not t.small_work(DIM, LIMIT)  # no update yet: the first sizes the map to the slots (a copy of it)
    for seq, i in enumerate((2 * BIG, 2 * BIG + 1), start=1):  # each a new row in the next slot, then updated
        t.store.lookup(torch.tensor([i]))
        t.push(RowsPush(0, "t0", 0, 1, seq, torch.tensor([i]), torch.ones(1, DIM)), members, now=0.0)
    assert t.updated_at.room_below(t.store.slot_bound(100))  # the map doubled past every slot in use
    assert t.small_work(DIM, LIMIT)


def test_row_calls_offload_a_call_that_would_grow_a_big_table_and_run_one_that_would_not_inline():
    runtime = FakeRuntime()
    grows, fits = big(table()), roomy(table())
    shard = SimpleNamespace(counters=Counter())
    shard.count = lambda name: shard.counters.update([name])
    calls = RowCalls(shard=shard, runtime=runtime, max_pull_wait=1.0)
    calls.run_all([(fits, 8 * DIM), (grows, 8 * DIM)], lambda: None)  # one trip: on the loop only if all are
    calls.run_all([(fits, 8 * DIM)], lambda: None)
    calls.run(fits, 8 * DIM, fits.lookup, torch.arange(2 * BIG, 2 * BIG + 8))
    calls.run(grows, 8 * DIM, grows.lookup, torch.arange(BIG, BIG + 8))  # (it grows the table, as foreseen)
    assert runtime.went == ["worker", "loop", "loop", "worker"]
    assert shard.counters == {"row_work_offloaded": 2, "row_work_inline": 2}  # where it ran, in the shard's stats
