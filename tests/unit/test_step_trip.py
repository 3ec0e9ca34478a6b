"""A Step's one trip to the state worker (psserver.serving.step_trip), with fake tables and shard, no network: the order
its work runs in, what a refusal leaves untouched, and which pulls it answers itself."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from psserver.protocol.errors import InvalidRequest, StaleGradient
from psserver.serving.step_trip import TablePart, run_trip


class FakeTable:
    def __init__(self, name: str, log: list, mode: str = "async", refuse: bool = False, after_push: int = 1):
        self.name, self.log, self.mode, self.refuse = name, log, mode, refuse
        self.version, self.after_push = 0, after_push
        self.spec = SimpleNamespace(dim=2)

    def check_step_part(self, push, refuse_nonfinite, pull_ids, pushed=None):
        self.log.append(("check", self.name))
        if self.refuse:
            raise InvalidRequest(f"table {self.name} refuses")
        return ("pushed", self.name), None if pull_ids is None else ("checked", self.name)

    def ready(self, min_version: int) -> bool:
        return self.version >= min_version


class FakeShard:
    def __init__(self, tables: dict, log: list, failing: str = "", stale: str = ""):
        self.tables, self.log, self.failing, self.stale = tables, log, failing, stale
        self.refused_at_turn = ""
        self.counts: dict = {}
        self.deferred = None

    def check_row_push_lands(self, name, push):
        if name == self.refused_at_turn:
            raise InvalidRequest(f"push to {name} would take the round past the table's bounds")

    def push_rows(self, fingerprint, name, push, refuse_nonfinite, pushed):
        self.log.append(("push", name))
        assert pushed == ("pushed", name)  # the ids as the trip's check marked them
        if name == self.failing:
            raise InvalidRequest(f"push to {name} fails")
        if name == self.stale:
            raise StaleGradient(f"push to {name} is stale", 0, 9)
        table = self.tables[name]
        table.version += table.after_push
        return SimpleNamespace(outcome="applied", version=table.version)

    def pull_rows(self, rank, trainer_id, fingerprint, name, checked):
        self.log.append(("pull", name))
        return self.tables[name].version, torch.zeros(1, 2)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    @contextlib.contextmanager
    def checkpoints_after_trip(self):
        """Records where in the log the deferral of checkpoints began and ended."""
        begun = len(self.log)
        yield
        self.deferred = (begun, len(self.log))


def part(table: FakeTable, pull: bool = True) -> TablePart:
    h = SimpleNamespace(table=table.name, rank=0, trainer_id="t", fingerprint="f", version=0)
    push = SimpleNamespace(grads=torch.zeros(1, 2))
    return TablePart(h, table, push, torch.tensor([1]) if pull else None)


def setup(*specs, **shard_kw):
    log: list = []
    tables = {name: FakeTable(name, log, **kw) for name, kw in specs}
    return log, tables, FakeShard(tables, log, **shard_kw)


def test_checks_then_the_dense_push_then_each_tables_push_and_ready_pull_run_in_that_order():
    log, tables, shard = setup(("a", {}), ("b", {}))
    parts = [part(tables["a"]), part(tables["b"], pull=False)]
    out = run_trip(shard, parts, True, dense=lambda: log.append(("dense",)) or "dense result")
    assert out == "dense result"
    assert log == [("check", "a"), ("check", "b"), ("dense",), ("push", "a"), ("pull", "a"), ("push", "b")]
    # a checkpoint the dense push makes due is taken after the table pushes: never a table round half pushed
    assert shard.deferred == (log.index(("dense",)), len(log))
    assert parts[0].pulled[0] == 1 and parts[1].pulled is None and parts[1].result.version == 1


def test_a_refused_check_leaves_the_dense_slice_and_every_table_unpushed():
    log, tables, shard = setup(("a", {}), ("b", {"refuse": True}))
    with pytest.raises(InvalidRequest, match="table b refuses"):
        run_trip(shard, [part(tables["a"]), part(tables["b"])], True, dense=lambda: log.append(("dense",)))
    assert log == [("check", "a"), ("check", "b")]


def test_a_refused_dense_push_leaves_every_table_unpushed():
    log, tables, shard = setup(("a", {}),)

    def dense():
        raise InvalidRequest("the dense push is refused")

    with pytest.raises(InvalidRequest, match="dense push"):
        run_trip(shard, [part(tables["a"])], True, dense=dense)
    assert log == [("check", "a")]


def test_a_sync_pull_whose_round_is_still_open_is_left_for_the_wait_and_its_push_is_done():
    # the push is accepted into an open round (the version does not move): its pull waits for the close
    log, tables, shard = setup(("a", {"mode": "sync", "after_push": 0}),)
    shard.push_rows = lambda *a: log.append(("push", "a")) or SimpleNamespace(outcome="accepted", version=0)
    parts = [part(tables["a"])]
    run_trip(shard, parts, True)
    assert log == [("check", "a"), ("push", "a")]
    assert parts[0].pulled is None and parts[0].error is None and parts[0].result.outcome == "accepted"


def test_one_tables_failed_push_is_kept_on_its_part_and_the_other_tables_still_push():
    log, tables, shard = setup(("a", {}), ("b", {}), ("c", {}), failing="a", stale="b")
    parts = [part(tables[n]) for n in "abc"]
    run_trip(shard, parts, True)
    assert isinstance(parts[0].error, InvalidRequest) and isinstance(parts[1].error, StaleGradient)
    assert parts[2].error is None and parts[2].pulled is not None
    assert ("push", "c") in log and ("pull", "a") not in log and ("pull", "b") not in log
    assert shard.counts == {"row_pushes_stale": 1}  # counted as PushRows counts it


def test_a_shard_that_is_stopping_pulls_nothing_in_the_trip():
    log, tables, shard = setup(("a", {}),)
    parts = [part(tables["a"])]
    run_trip(shard, parts, True, stopping=lambda: True)
    assert parts[0].pulled is None and ("pull", "a") not in log


def test_a_table_push_that_would_be_refused_at_its_turn_is_refused_before_the_dense_push_and_nothing_runs():
    log = []
    tables = {"a": FakeTable("a", log), "b": FakeTable("b", log)}
    shard = FakeShard(tables, log)
    shard.refused_at_turn = "b"
    parts = [part(tables["a"]), part(tables["b"])]
    with pytest.raises(InvalidRequest, match="past the table's bounds"):
        run_trip(shard, parts, True, lambda: log.append(("dense",)))
    assert ("dense",) not in log and not any(e[0] in ("push", "pull") for e in log)
