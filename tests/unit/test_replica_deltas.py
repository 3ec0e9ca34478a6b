"""A standby's shipments after its first carry only the table rows touched since the one before
(psserver.replication.deltas): merged into the state they build on they give, bit for bit, the whole state
the primary holds -- its rows, optimizer state, clocks, update versions, and the digest of a table restored from
it -- for async and sync tables, rows created, read, updated and (then whole again) evicted."""

import hashlib

import pytest
import torch

from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import ROW_FIELDS, TableSpec
from psserver.replication.deltas import decoded, merge, merge_all, whole
from psserver.replication.live import Holdings
from psserver.sparse.serving import PARTIAL_FROM, WHOLE_PAST, Membership, RowsPush, ServedTable
from psserver.state.checkpoint import ShardState

DIM = 4
BOTH = Membership(frozenset({0, 1}), started=True)


def job(mode: str, optimizer: str = "adagrad", **table) -> JobSpec:
    spec = TableSpec("emb", DIM, optimizer=SparseOptimizerConfig(optimizer, lr=0.1), seed=3, mode=mode, **table)
    return JobSpec(mode=mode, num_trainers=2, num_shards=1, total_params=4, fingerprint="f" * 16,
                   optimizer=OptimizerConfig("sgd", lr=0.1), tensors=(("w", (4,), "float32"),), tables=(spec,))


def shard_state(j: JobSpec, tables: dict, version: int = 0) -> ShardState:
    return ShardState(0, version, j, torch.zeros(4), {}, tables=tables)


def digest(t: ServedTable) -> str:
    h = hashlib.sha256()
    t.digest(h)
    return h.hexdigest()


class Driver:
    """Random calls on one table: pulls of new and old ids, pushes from two ranks (each rank's sequence)."""

    def __init__(self, t: ServedTable, seed: int):
        self.t, self.g, self.seq = t, torch.Generator().manual_seed(seed), {0: 0, 1: 0}

    def ids(self) -> torch.Tensor:
        return torch.unique(torch.randint(0, 2 * PARTIAL_FROM, (30,), generator=self.g))

    def step(self, rank: int) -> None:
        ids = self.ids()
        self.t.lookup(ids)
        self.seq[rank] += 1
        grads = torch.randn(len(ids), DIM, generator=self.g)
        self.t.push(RowsPush(rank, f"t{rank}", self.t.version, 1, self.seq[rank], ids, grads), BOTH, now=0.0)


def assert_same_table_state(a: dict, b: dict) -> None:
    for name in ROW_FIELDS:
        assert torch.equal(a["rows"][name], b["rows"][name]), name
    assert {k: v for k, v in a["rows"].items() if k not in ROW_FIELDS and k != "sketch"} == \
        {k: v for k, v in b["rows"].items() if k not in ROW_FIELDS and k != "sketch"}
    for key in ("ids", "versions"):
        assert torch.equal(a["updated_at"][key], b["updated_at"][key]), key
    assert {k: a[k] for k in ("version", "acked", "counts", "holes")} == {k: b[k] for k in ("version", "acked", "counts",
                                                                                           "holes")}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_shipments_of_the_rows_touched_since_merged_in_turn_give_the_whole_state_bit_for_bit(mode):
    j = job(mode)
    t, twin = ServedTable(j.tables[0], j), ServedTable(j.tables[0], j)
    drive = Driver(t, seed=1)
    t.lookup(torch.arange(0, 2 * PARTIAL_FROM, 2))  # (rows enough to ship partial: PARTIAL_FROM)
    for k in range(6):
        drive.step(k % 2)
    held = shard_state(j, {"emb": t.state()})
    mark = t.store.mark()
    sizes = []
    for shipment in range(5):
        for k in range(3):  # (sync: an odd count leaves a round open, its sums in the shipment whole)
            drive.step(k % 2)
        later = t.state(mark)
        assert "since" in later["rows"]  # only what was touched: fewer rows than the table holds
        sizes.append((len(later["rows"]["ids"]), len(t.store)))
        mark = t.store.mark()
        held = merge(held, shard_state(j, {"emb": later}))
        assert_same_table_state(held.tables["emb"], t.state())
    assert all(touched * WHOLE_PAST <= live for touched, live in sizes), sizes
    twin.restore(held.tables["emb"], now=0.0)
    assert digest(twin) == digest(t)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_many_shipments_merged_at_once_give_what_merging_them_in_turn_gives(mode):
    """A fold merges a table once over every shipment since its last whole one (each id's newest row and update
    version), with a whole shipment among them (an eviction's) starting the run again."""
    j = job(mode, max_rows=2 * PARTIAL_FROM)
    t = ServedTable(j.tables[0], j)
    drive = Driver(t, seed=5)
    t.lookup(torch.arange(0, 2 * PARTIAL_FROM, 2))
    drive.step(0)
    base = shard_state(j, {"emb": t.state()})
    mark, shipments, in_turn, kinds = t.store.mark(), [], base, []
    for n in range(8):
        for k in range(3):
            drive.step(k % 2)
        if n == 4:  # past max_rows: rows evicted, so this shipment of the table is whole
            t.lookup(torch.arange(4 * PARTIAL_FROM, 4 * PARTIAL_FROM + PARTIAL_FROM + 10))
        later = t.state(mark)
        kinds.append("since" in later["rows"])
        mark = t.store.mark()
        shipments.append(shard_state(j, {"emb": later}, version=n + 1))
        in_turn = merge(in_turn, shipments[-1])
    first_whole = kinds.index(False)  # (LRU evicts again as the table refills: later ones may be whole too)
    assert kinds[:4] == [True] * 4 and first_whole == 4 and kinds[5], kinds
    at_once = merge_all(base, shipments)
    assert at_once.version == 8
    assert_same_table_state(at_once.tables["emb"], t.state())
    assert_same_table_state(at_once.tables["emb"], in_turn.tables["emb"])
    three = base
    for s in shipments[:3]:
        three = merge(three, s)
    assert_same_table_state(merge_all(base, shipments[:3]).tables["emb"], three.tables["emb"])


def test_a_table_whose_rows_were_mostly_touched_since_ships_whole():
    j = job("async")
    t = ServedTable(j.tables[0], j)
    n = WHOLE_PAST * PARTIAL_FROM
    t.lookup(torch.arange(n))
    mark = t.store.mark()
    t.lookup(torch.arange(n // WHOLE_PAST + 1))  # more than 1/WHOLE_PAST of its rows
    assert "since" not in t.state(mark)["rows"] and len(t.state(mark)["rows"]["ids"]) == n
    mark = t.store.mark()
    t.lookup(torch.arange(n // WHOLE_PAST))  # 1/WHOLE_PAST
    assert "since" in t.state(mark)["rows"] and len(t.state(mark)["rows"]["ids"]) == n // WHOLE_PAST


def test_a_table_of_fewer_rows_than_partial_from_ships_whole():
    j = job("async")
    t = ServedTable(j.tables[0], j)
    t.lookup(torch.arange(PARTIAL_FROM - 1))
    mark = t.store.mark()
    t.lookup(torch.arange(3))
    assert "since" not in t.state(mark)["rows"]


def test_after_an_eviction_the_next_shipment_of_the_table_is_whole():
    j = job("async", max_rows=PARTIAL_FROM + 100)
    t = ServedTable(j.tables[0], j)
    t.lookup(torch.arange(PARTIAL_FROM + 90))
    mark = t.store.mark()
    assert "since" in t.state(mark)["rows"]
    t.lookup(torch.arange(PARTIAL_FROM + 90, PARTIAL_FROM + 150))  # past max_rows: the least recently used rows go
    assert t.store.counts.evicted_lru > 0
    later = t.state(mark)
    assert "since" not in later["rows"] and len(later["rows"]["ids"]) == len(t.store)
    assert_same_table_state(merge(shard_state(j, {}), shard_state(j, {"emb": later})).tables["emb"], t.state())


def test_whole_reads_shipments_as_bytes_and_a_standby_applies_them_into_the_same_state():
    j = job("async")
    t = ServedTable(j.tables[0], j)
    drive = Driver(t, seed=2)
    t.lookup(torch.arange(0, 2 * PARTIAL_FROM, 2))
    drive.step(0)
    holdings, plain = Holdings(), []
    try:
        base = [shard_state(j, {"emb": t.state()}).to_bytes()]
        holdings.take_whole(base, 1)
        mark = t.store.mark()
        for n in range(2, 12):
            drive.step(n % 2)
            partial = t.state(mark)
            assert "since" in partial["rows"]
            shipment = [shard_state(j, {"emb": partial}, version=n).to_bytes()]
            mark = t.store.mark()
            assert holdings.take_since(shipment, n, base=n - 1)
            plain.append(shipment)
        assert not holdings.take_since(shipment, 13, base=10)  # a base it does not hold now: refused, nothing changed
        assert holdings.shipment == 11
        for state in (holdings.states()[0], whole(base, plain)[0]):  # (states waits for the applying thread)
            assert state.version == 11
            assert_same_table_state(state.tables["emb"], t.state())
        assert holdings.applied == 11
    finally:
        holdings.close()


def test_a_standby_with_nothing_whole_refuses_a_shipment_that_builds_on_one():
    holdings = Holdings()
    try:
        assert not holdings.take_since([b"x"], 2, base=1)
    finally:
        holdings.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shipments_applied_as_they_come_equal_the_reference_merge_through_an_eviction_and_dense_steps(mode):
    """Differential: a table with a row limit (evictions: whole again) next to a dense slice shipped as its steps;
    after every shipment the live state equals ``deltas.whole`` of the same shipments and the primary's own, bit
    for bit -- rows, clocks, update versions, slice and optimizer state."""
    from collections import Counter

    from psserver.state.dense_slice import DenseSlice

    j = replace_optimizer(job(mode, max_rows=3 * PARTIAL_FROM), "adam")
    t = ServedTable(j.tables[0], j)
    drive = Driver(t, seed=9)
    t.lookup(torch.arange(0, 2 * PARTIAL_FROM, 2))
    g = torch.Generator().manual_seed(1)
    dense = DenseSlice(Counter())
    dense.init(torch.randn(4, generator=g), take=False, optimizer=j.optimizer)
    dense.step(torch.randn(4, generator=g), 0.1)

    def state(version, tables, steps=None, since=0):
        params, opt = dense.capture() if steps is None else (None, None)
        return ShardState(0, version, j, params, opt, tables=tables,
                          dense_steps=None if steps is None else {"since": since, "steps": steps})

    holdings, plain = Holdings(), []
    try:
        base = [state(dense.version, {"emb": t.state()}).to_bytes(shipment=True)]
        holdings.take_whole(base, 1)
        mark, wholes = t.store.mark(), 0
        dense.log_steps()
        for n in range(2, 14):
            if n != 10:  # (at 10 no row is touched: the table ships no rows, its empty tensors as they come)
                drive.step(n % 2)
            if n == 7:  # past the row limit: the oldest rows go, and the next shipment of the table is whole
                t.lookup(torch.arange(10 * PARTIAL_FROM, 10 * PARTIAL_FROM + 2 * PARTIAL_FROM))
            since = dense.version
            dense.step(torch.randn(4, generator=g), 0.1)
            table = t.state(mark)
            wholes += "since" not in table["rows"]
            shipment = [state(dense.version, {"emb": table}, dense.take_steps(since), since).to_bytes(shipment=True)]
            mark = t.store.mark()
            assert holdings.take_since(shipment, n, base=n - 1)
            plain.append(shipment)
            live, reference = holdings.states()[0], whole(base, plain)[0]
            assert_same_table_state(live.tables["emb"], reference.tables["emb"])
            assert_same_table_state(live.tables["emb"], t.state())
            params, opt = dense.capture()
            assert torch.equal(live.params, reference.params) and torch.equal(live.params, params)
            for key, value in opt["state"][0].items():
                assert torch.equal(live.optimizer["state"][0][key], value) if torch.is_tensor(value) else \
                    live.optimizer["state"][0][key] == value, key
        assert wholes >= 1 and len(plain) - wholes >= 5  # (both kinds of shipment were applied)
    finally:
        holdings.close()


def replace_optimizer(j: JobSpec, name: str) -> JobSpec:
    from dataclasses import replace
    return replace(j, optimizer=OptimizerConfig(name, lr=0.1))


def test_a_shipment_that_does_not_apply_leaves_no_state_until_a_whole_one_comes():
    """A shipment that does not build on what is held (here: dense steps from a version the slice is not at) is
    said, the state held is unusable (a promotion says why), the next shipment is refused so that the primary
    ships a whole state, and that whole state is taken."""
    j = dense_job("adam", 10)
    good = ShardState(0, 3, j, torch.zeros(10), {"state": {}, "param_groups": [{"lr": 0.1}]})
    bad = ShardState(0, 5, j, None, None, dense_steps={"since": 4, "steps": [(torch.ones(10), 0.1)]})
    holdings = Holdings()
    try:
        holdings.take_whole([good.to_bytes(shipment=True)], 1)
        assert holdings.take_since([bad.to_bytes(shipment=True)], 2, base=1)
        with pytest.raises(ValueError, match="shipment 2 did not apply"):
            holdings.states()
        assert not holdings.take_since([bad.to_bytes(shipment=True)], 3, base=2)  # refused: a whole state is due
        holdings.take_whole([good.to_bytes(shipment=True)], 4)
        assert decoded(holdings.states()[0]).version == 3  # (a whole state alone is held as shipped)
    finally:
        holdings.close()


def test_the_rows_noted_since_the_newest_mark_are_the_rows_a_scan_of_the_clocks_finds():
    """state_since of the newest mark reads the slots noted as they were touched; of an older mark (or past the
    table's size of notes) it scans every row's clock -- the same rows either way."""
    j = job("async")
    t = ServedTable(j.tables[0], j)
    t.lookup(torch.arange(0, 2 * PARTIAL_FROM, 2))
    drive = Driver(t, seed=4)
    older = t.store.mark()
    drive.step(0)
    newest = t.store.mark()
    for k in range(4):
        drive.step(k % 2)
    noted = t.store.state_since(newest)
    scanned = {**t.store.touched_since(newest[0])}
    for name in ROW_FIELDS:
        assert torch.equal(noted[name], scanned[name]), name
    assert len(noted["ids"]) > 0
    older_rows = t.store.state_since(older)  # (not the newest mark: scanned)
    assert torch.equal(older_rows["ids"], t.store.touched_since(older[0])["ids"])
    assert len(older_rows["ids"]) >= len(noted["ids"])


def dense_job(name: str, n: int) -> JobSpec:
    return JobSpec(mode="sync", num_trainers=2, num_shards=1, total_params=n, fingerprint="f" * 16,
                   optimizer=OptimizerConfig(name, lr=0.1, **({"momentum": 0.9} if name == "sgd" else {})),
                   tensors=(("w", (n,), "float32"),))


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_dense_steps_replayed_on_the_slice_held_give_the_primarys_slice_bit_for_bit(name):
    """A shipment may carry the slice's steps since the one before instead of the slice and its optimizer state:
    replayed on what the standby holds (across shipments, a version without a step among them) they give the
    primary's parameters and optimizer state exactly."""
    from collections import Counter

    from psserver.state.dense_slice import DenseSlice

    n = 1000  # (not a multiple of the optimizer's vector width: the tail is stepped too)
    j, g = dense_job(name, n), torch.Generator().manual_seed(7)
    primary = DenseSlice(Counter())
    primary.init(torch.randn(n, generator=g), take=False, optimizer=j.optimizer)
    primary.step(torch.randn(n, generator=g), 0.1)  # (the optimizer's state exists: steps are worth logging)

    def capture(steps=None, since=0):
        params, opt = primary.capture() if steps is None else (None, None)
        return ShardState(0, primary.version, j, params, opt,
                          dense_steps=None if steps is None else {"since": since, "steps": steps})

    base = capture()
    primary.log_steps()
    shipments = []
    for k in range(3):
        since = primary.version
        primary.step(torch.randn(n, generator=g), 0.1 / (k + 1))
        if k == 1:
            primary.advance()  # (a round whose every gradient was skipped)
        steps = primary.take_steps(since)
        assert steps is not None and len(steps) == (2 if k == 1 else 1)
        shipments.append(capture(steps, since))
    held = merge_all(base, shipments)
    params, opt = primary.capture()
    assert held.version == primary.version and held.dense_steps is None
    assert torch.equal(held.params, params)
    state, expected = held.optimizer["state"].get(0, {}), opt["state"].get(0, {})
    assert state.keys() == expected.keys() and state
    for key, value in expected.items():
        assert torch.equal(state[key], value) if torch.is_tensor(value) else state[key] == value, key
    with pytest.raises(ValueError, match="replays steps from version"):  # (a gap: never applied on a guess)
        merge_all(base, shipments[1:])


def test_a_step_log_longer_than_the_whole_slice_is_dropped_and_a_failed_step_drops_it():
    from collections import Counter

    from psserver.state.dense_slice import DenseSlice

    j = dense_job("adam", 100)
    s = DenseSlice(Counter())
    s.init(torch.zeros(100), take=False, optimizer=j.optimizer)
    s.step(torch.ones(100), 0.1)
    s.log_steps()
    since = s.version
    s.step(torch.ones(100), 0.1)
    s.step(torch.ones(100), 0.1)  # (two gradients: less than the slice and Adam's two moments)
    assert len(s.take_steps(since)) == 2
    since = s.version
    for _ in range(3):
        s.step(torch.ones(100), 0.1)
    assert s.take_steps(since) is None  # three weigh as much as the whole: shipped whole
    since = s.version
    with pytest.raises(RuntimeError):
        s.step(torch.ones(7), 0.1)  # (a gradient of the wrong size: the step fails part way)
    assert s.take_steps(since) is None
    assert s.take_steps(s.version) == []  # (the log started again)
