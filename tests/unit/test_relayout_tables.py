"""A trainer's tables follow a layout switch (trainer.membership.relayout, trainer.tables.row_lanes, trainer.tables.sparse_client): the row
routing, lanes and row calls rebuilt for the new shard count -- pure, no call made (gRPC channels connect lazily)."""

import dataclasses
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from psserver.protocol.errors import JobMismatch, LayoutMoved
from psserver.protocol.layout import Layout
from psserver.protocol.layouts import LayoutEpoch, new_job
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import TableSpec
from tests.conftest import make_spec
from tests.unit.test_relayout import TIMELINE, _client, _Error
from trainer.stepping.attempt import rows_moved
from trainer.channels.client import ShardedClient
from trainer.membership.relayout import LayoutNotFollowed, Relayout
from trainer.tables.row_lanes import Pending, RowLanes
from trainer.tables.sparse_client import RowsPushFailed, ShardedRows

JOB = make_spec(num_shards=2, tables=(TableSpec("emb", 4), TableSpec("cat", 2)))
JOB = dataclasses.replace(JOB, fingerprint=Layout.from_shapes(JOB.tensors, 2).fingerprint())
ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]


def lanes_after_steps(steps=3, shards=2):
    """Lanes of tables emb and cat on ``shards`` shards after ``steps`` answered sync pushes (cat's numbering one
    ahead on shard 1: a push answered there once more, as after a retry's number)."""
    book = RowLanes({"emb": "sync", "cat": "sync"}, shards, Counter(), threading.Lock())
    for (shard, name), lane in book.lanes.items():
        for base in range(steps):
            lane.number()
            lane.refs.record(base + 1, torch.arange(3))
            book.answered(lane, name, "applied", base, base + 1, 1)
    book.lanes[(1, "cat")].number()  # a push under way there: number 4 given out, unanswered
    return book


def test_new_lanes_start_at_each_tables_switch_round_numbered_on_from_the_old_ones_remembering_no_pull():
    book = lanes_after_steps()
    book.relaid(3, {"emb": 3, "cat": 3})
    assert sorted(book.lanes) == sorted((s, n) for s in range(3) for n in ("emb", "cat")) and book.num_shards == 3
    for (shard, name), lane in book.lanes.items():
        assert (lane.version, lane.base, lane.wait_for) == (3, 3, 3)
        assert lane.refs.name(torch.arange(3)) is None  # the old shards' pulls are never named to a new one
        assert lane.number() == (5 if name == "cat" else 4)  # above every number sent before, on every new shard
    assert book.versions() == {"emb": [3, 3, 3], "cat": [3, 3, 3]}


def test_lanes_refuse_a_switch_while_a_push_is_kept_or_off_the_tables_round_naming_why():
    book = lanes_after_steps()
    assert book.off_round({"emb": 3, "cat": 3}) == ""
    assert "table 'cat''s next push on shard 0 has base version 3 but the new layout takes the table over from " \
           "round 4" in book.off_round({"emb": 3, "cat": 4})
    book.pending["emb"] = Pending({0: (), 1: ()})
    assert "a push of table 'emb' failed and waits to be retried in the old layout" in \
           book.off_round({"emb": 3, "cat": 3})
    assert book.off_round({"emb": 3, "cat": 3}, taking_back={"emb"}) == ""  # refused everywhere: re-sent whole


def test_a_table_push_is_taken_back_only_when_every_shard_refused_it_layout_moved_and_none_answered():
    moved = {0: _Error(LayoutMoved("x", newest=1)), 1: _Error(LayoutMoved("x", newest=1))}
    assert rows_moved(RowsPushFailed("emb", [], moved, ADDRESSES)) == 1
    assert rows_moved(RowsPushFailed("emb", [0], {1: moved[1]}, ADDRESSES)) is None  # one shard applied it
    assert rows_moved(RowsPushFailed("emb", [], {0: moved[0], 1: _Error(JobMismatch("x"))}, ADDRESSES)) is None
    assert rows_moved(RuntimeError("x")) is None and rows_moved(_Error(LayoutMoved("x", newest=1))) is None


def test_the_rows_client_splits_ids_by_the_new_shard_count_over_the_new_shards_and_forgets_the_old_ones():
    client = ShardedClient(ADDRESSES, JOB, 0, "t0")
    rows = ShardedRows(client, JOB)
    try:
        rows.use_cache("emb", 100, max_staleness=5)
        for (shard, name), lane in rows.book.lanes.items():
            lane.version = lane.base = lane.wait_for = 2
        rows.caches["emb"].insert(torch.arange(4), torch.ones(4, 4), torch.full((4,), 2), shard_of(torch.arange(4), 2))
        rows.prefetch("emb", torch.arange(6))
        old_calls = rows.calls
        job = new_job(JOB, 3)
        client.replace_parts(job, ADDRESSES + ["127.0.0.1:3"], ShardedClient(
            ADDRESSES + ["127.0.0.1:3"], job, 0, "t0").parts)
        rows.relaid(job, {"emb": 2, "cat": 2})
        ids = torch.arange(100)
        assert [len(p) for p in rows.split(ids)] == [int((shard_of(ids, 3) == s).sum()) for s in range(3)]
        assert rows.calls is not old_calls and len(rows.calls._pull) == 3 and rows.book.num_shards == 3
        assert rows.ahead.num_shards == 3 and rows.ahead.take("emb", torch.arange(6)) is None  # prefetch dropped
        assert len(rows.caches["emb"]) == 0 and rows.counters["cache_dropped"] == 4
        assert rows.counters["tables_relaid"] == 1 and rows.versions() == {"emb": [2, 2, 2], "cat": [2, 2, 2]}
    finally:
        rows.close()
        client.close()


class _Rows:
    """What Relayout asks of the tables' client; refuses with ``why``."""

    tables = {"emb": None}

    def __init__(self, why):
        self.why, self.asked = why, []

    def off_round(self, rounds, taking_back=frozenset()):
        self.asked.append(rounds)
        return self.why


def test_a_trainer_whose_tables_cannot_follow_refuses_the_switch_by_its_reason_and_changes_nothing():
    client = _client([1, 1])
    slots = SimpleNamespace(client=client, ranges=[(0, 5), (5, 10)])
    rows = _Rows("a push of table 'emb' failed and waits to be retried in the old layout")
    relayout = Relayout(slots, session=None, rows=lambda: rows)
    with pytest.raises(LayoutNotFollowed, match="layout 1 takes the tables over from rounds \\{'emb': 5\\} but a push "
                                                "of table 'emb' failed"):
        relayout.switch_if_due(5)
    assert slots.ranges == [(0, 5), (5, 10)] and relayout.epoch == 0 and rows.asked == [{"emb": 5}]
    assert TIMELINE[1].start("emb") == 5  # (a layout naming no table round takes tables over from its dense round)


def test_a_variant_that_cannot_follow_is_named_as_it_runs_at_the_switch_and_refuses_before_the_tables_are_asked():
    client = _client([1, 1])
    slots = SimpleNamespace(client=client, ranges=[(0, 5), (5, 10)])
    running, rows = [""], _Rows("stop here")
    relayout = Relayout(slots, session=None, unsupported=lambda: running[0], rows=lambda: rows)
    with pytest.raises(LayoutNotFollowed, match="stop here"):
        relayout.switch_if_due(5)
    running[0] = "async tables"
    with pytest.raises(LayoutNotFollowed, match="runs async tables, which cannot follow a layout switch yet"):
        relayout.switch_if_due(5)
    assert len(rows.asked) == 1 and relayout.epoch == 0
    assert LayoutEpoch(1, 5, 1, table_rounds=(("emb", 7),)).start("emb") == 7
