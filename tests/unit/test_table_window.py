"""The async tables' push window (trainer.tables.table_window) with a fake row client: no network.  Each fake push
waits until the test releases it, so what is in flight when is decided by the test, not by timing."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest
import torch

from psserver.protocol.limits import ROW_PUSHES_ON_WIRE_PER_SHARD
from tests.helpers import wait_until
from trainer.tables.push_window import WindowFailed
from trainer.tables.row_lanes import RowLanes
from trainer.tables.sparse_client import RowsPushFailed
from trainer.tables.table_window import TableWindows


class Code(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name


class Shard:
    def __init__(self, index: int):
        self.index, self.address = index, f"127.0.0.1:{1 + index}"


class FakeRows:
    """What TableWindows uses of ShardedRows; ``push_once`` records (shard, sequence, base) and waits for its
    gate (one per push call, in order), then answers what the test put in ``answers`` (default: applied)."""

    def __init__(self, shards: int = 2):
        self.client = type("C", (), {"shards": [Shard(i) for i in range(shards)]})()
        self.counters: Counter = Counter()
        self.book = RowLanes({"t": "async"}, shards, self.counters, threading.Lock())
        self.calls: list[tuple[int, int, int]] = []
        self.gates: dict[tuple[int, int], threading.Event] = {}  # (shard, sequence) -> released
        self.answers: dict[tuple[int, int], list] = {}  # (shard, sequence) -> errors to raise, in turn
        self.restarts: list[int] = []
        self.windows: TableWindows | None = None
        self.free = False  # every push answers at once
        self._lock = threading.Lock()

    def count(self, **n):
        with self._lock:
            self.counters.update(n)

    def gate(self, shard: int, seq: int) -> threading.Event:
        with self._lock:
            return self.gates.setdefault((shard, seq), threading.Event())

    def release(self, seq: int, shards=(0, 1)) -> None:
        for s in shards:
            self.gate(s, seq).set()

    def part(self, shard, table, ids, grads, n, claim, numbered=None):
        return numbered

    def push_once(self, shard, numbered):
        seq, base = numbered
        with self._lock:
            self.calls.append((shard.index, seq, base))
        if not self.free:
            self.gate(shard.index, seq).wait(timeout=30)
        errors = self.answers.get((shard.index, seq))
        if errors:
            raise errors.pop(0)
        return "applied"

    def on_restart(self, shard, error):
        self.restarts.append(shard.index)
        self.windows.resynced(shard.index)


def payloads(shards: int = 2):
    return {s: (torch.tensor([s]), torch.ones(1, 2), 1) for s in range(shards)}


def windows(size: int, shards: int = 2) -> tuple[FakeRows, TableWindows]:
    rows = FakeRows(shards)
    rows.windows = TableWindows(rows, ["t"], size)
    return rows, rows.windows


def in_background(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_each_push_takes_numbers_of_its_own_and_the_base_its_rows_were_read_at():
    rows, w = windows(4)
    rows.free = True
    for s in range(2):
        rows.book.lanes[(s, "t")].base = 5
    w.hand_in("t", payloads())
    w.hand_in("t", payloads())
    w.flush()
    assert sorted(rows.calls) == [(0, 1, 5), (0, 2, 5), (1, 1, 5), (1, 2, 5)]
    assert w.in_flight_of("t") == [0, 0] and rows.counters["window_pushes_sent"] == 2
    w.close()


def test_an_answer_in_the_background_leaves_the_lanes_base_at_the_rows_read():
    book = RowLanes({"t": "async"}, 1, Counter(), threading.Lock())
    lane = book.lanes[(0, "t")]
    lane.base = 3
    assert book.answered(lane, "t", "applied", 3, 9, 1, windowed=True) == "applied"
    assert (lane.version, lane.base) == (9, 3)
    book.answered(lane, "t", "applied", 3, 10, 1)  # unwindowed: the next push goes on from its own step
    assert lane.base == 10


def test_a_full_window_blocks_the_push_until_one_is_answered_and_counts_in_flight_per_lane():
    rows, w = windows(2)
    w.hand_in("t", payloads())  # one in flight: returns at once
    assert w.in_flight_of("t") == [1, 1]
    second = in_background(lambda: w.hand_in("t", payloads()))
    wait_until(lambda: w.windows["t"].stats.full_waits == 1, "the second push to find the window full")
    assert second.is_alive() and w.in_flight_of("t") == [2, 2]
    rows.release(1)
    second.join(timeout=30)
    assert not second.is_alive() and rows.counters["window_full_waits"] == 1
    rows.release(2)
    w.flush()
    assert w.in_flight_of("t") == [0, 0]
    w.close()


def test_a_failed_push_is_sent_again_under_its_numbers_to_the_shards_that_did_not_answer():
    rows, w = windows(4)
    rows.free = True
    rows.answers[(1, 1)] = [Code(grpc.StatusCode.UNAVAILABLE)]
    w.hand_in("t", payloads())
    with pytest.raises(RowsPushFailed) as e:
        w.flush()
    assert list(e.value.failed) == [1] and e.value.done == [0] and e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert w.failed("t") and w.in_flight_of("t") == [0, 1]
    w.flush()  # sent again: shard 1 only, number 1 again
    assert sorted(rows.calls) == [(0, 1, 0), (1, 1, 0), (1, 1, 0)]
    assert not w.failed("t") and rows.counters["window_pushes_retried"] == 1 and w.in_flight_of("t") == [0, 0]
    w.close()


def test_a_push_call_that_raised_after_handing_its_push_in_does_not_send_it_twice():
    rows, w = windows(1)  # W=1: the push waits for its own answer, so its failure is raised from push()
    rows.free = True
    rows.answers[(0, 1)] = [Code(grpc.StatusCode.UNAVAILABLE)]
    with pytest.raises(WindowFailed):
        w.hand_in("t", payloads())
    assert w.failed("t")
    w.hand_in("t", payloads())  # the caller's retry with the same gradient: the failed push again, nothing new
    assert sorted(rows.calls) == [(0, 1, 0), (0, 1, 0), (1, 1, 0)] and not w.failed("t")
    w.hand_in("t", payloads())  # the next step: new numbers
    w.flush()
    assert sorted(rows.calls) == [(0, 1, 0), (0, 1, 0), (0, 2, 0), (1, 1, 0), (1, 2, 0)]
    w.close()


def test_a_restart_is_rejoined_once_and_every_push_to_it_that_found_it_is_lost_and_counted():
    rows, w = windows(4)
    for seq in (1, 2):
        rows.answers[(1, seq)] = [Code(grpc.StatusCode.NOT_FOUND)]
    w.hand_in("t", payloads())
    w.hand_in("t", payloads())  # both made before the restart is found
    rows.release(1)
    rows.release(2)
    w.flush()
    assert rows.restarts == [1] and rows.counters["pushes_lost"] == 2 and w.in_flight_of("t") == [0, 0]
    rows.answers[(1, 3)] = [Code(grpc.StatusCode.NOT_FOUND)]  # a second restart, found by a later push
    w.hand_in("t", payloads())
    rows.release(3)
    w.flush()
    assert rows.restarts == [1, 1] and rows.counters["pushes_lost"] == 3
    w.close()


def test_abandon_drops_the_failed_push_and_the_next_gets_new_numbers():
    rows, w = windows(4)
    rows.free = True
    rows.answers[(1, 1)] = [Code(grpc.StatusCode.UNAVAILABLE)]
    w.hand_in("t", payloads())
    with pytest.raises(RowsPushFailed):
        w.flush()
    assert w.abandon("t") == 1 and not w.failed("t") and w.in_flight_of("t") == [0, 0]
    w.hand_in("t", payloads())
    w.flush()
    assert sorted(rows.calls) == [(0, 1, 0), (0, 2, 0), (1, 1, 0), (1, 2, 0)]  # 1 not sent again
    w.close()


def test_a_cached_row_ages_by_this_trainers_pushes_still_in_flight():
    """A row cache compares a row's version with the version the trainer knows (ShardedRows.known_versions):
    with pushes in flight that is the lane's version plus them, so a row is never served past its bound."""
    from tests.integration.test_sparse_rpc import job
    from trainer.channels.client import ShardedClient
    from trainer.tables.sparse_client import ShardedRows

    spec = job(num_shards=2, mode="async")
    client = ShardedClient(["127.0.0.1:1", "127.0.0.1:2"], spec, 0, "t0")
    r = ShardedRows(client, spec)
    try:
        r.use_window(4)
        r.book.lanes[(0, "emb")].version = 7
        r.window.in_flight.update({(0, "emb"): 3, (1, "emb"): 1})
        assert r.known_versions("emb").tolist() == [10, 1]
    finally:
        r.close()
        client.close()


def test_a_pull_answered_before_a_push_beside_it_is_not_a_shard_going_back():
    book = RowLanes({"t": "async"}, 1, Counter(), threading.Lock())
    lane = book.lanes[(0, "t")]
    lane.version = 5  # a windowed push was answered at 5 while a pull sent at 4 was out
    assert not book.pulled(0, "t", 4, seen=4) and lane.version == 5 and book.counters["versions_lost"] == 0
    assert book.pulled(0, "t", 2, seen=4) and lane.version == 2 and book.counters["versions_lost"] == 2


def test_many_tables_windows_keep_each_shards_pushes_on_the_wire_under_the_shards_per_rank_cap():
    tables, size = [f"t{i}" for i in range(4)], 4  # 16 pushes a shard may be in flight, over the cap
    rows = FakeRows()
    rows.book = RowLanes({t: "async" for t in tables}, 2, rows.counters, threading.Lock())
    w = rows.windows = TableWindows(rows, tables, size)
    for _ in range(size - 1):  # each table's window takes W-1 without waiting
        for t in tables:
            w.hand_in(t, payloads())
    waiting = len(tables) * (size - 1) - ROW_PUSHES_ON_WIRE_PER_SHARD
    wait_until(lambda: rows.counters["window_wire_waits"] == 2 * waiting, "the parts past the cap to wait")
    on_wire = Counter(s for s, _, _ in rows.calls)
    assert on_wire == {0: ROW_PUSHES_ON_WIRE_PER_SHARD, 1: ROW_PUSHES_ON_WIRE_PER_SHARD}
    rows.free = True
    for seq in range(1, size):
        rows.release(seq)
    w.flush()
    assert len(rows.calls) == 2 * len(tables) * (size - 1)  # every part sent once, none refused or lost
    assert all(n == 0 for t in tables for n in w.in_flight_of(t))
    w.close()
