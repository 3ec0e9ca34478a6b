"""The fault bookkeeping of sparse tables without a network: the shard's refusal of a pull it can never answer
(psserver.sparse.serving.ServedTable.check_wait), and ShardedRows' resync after a restart and abandon.

ShardedRows is built on a ShardedClient whose channels are never used (gRPC connects lazily).
"""

import grpc
import pytest
import torch

from psserver.protocol.errors import FutureVersion
from psserver.sparse.serving import Membership
from tests.integration.test_sparse_rpc import job
from tests.unit.test_embedding_api import FlakyRows, Tower, stepper
from tests.unit.test_sparse_serving import push, served
from trainer.channels.client import ShardedClient
from trainer.tables.sparse_client import RowsPushFailed, ShardedRows

BOTH = Membership(frozenset({0, 1}), started=True)


def test_a_sync_pull_for_the_close_of_the_round_it_pushed_into_is_allowed():
    t = served("sync")
    t.push(push(0, [1, 2]), BOTH, now=0.0)
    t.check_wait(0, 1)  # rank 0 is in the open round: version 1 will come
    t.check_wait(1, 0)


def test_a_pull_past_the_next_version_or_for_a_round_without_its_push_is_refused_out_of_range():
    t = served("sync")
    t.push(push(0, [1, 2]), BOTH, now=0.0)
    with pytest.raises(FutureVersion, match="min_version is 2 but table 'emb' is at version 0") as e:
        t.check_wait(0, 2)
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(FutureVersion, match="holds no push of rank 1"):
        t.check_wait(1, 1)  # rank 1's push is not in the round: a restored shard lost it


def test_an_async_pull_is_never_refused_for_its_min_version():
    served("async").check_wait(0, 5)


def rows(num_shards=2) -> ShardedRows:
    spec = job(num_shards=num_shards, mode="sync")
    client = ShardedClient([f"127.0.0.1:{1 + i}" for i in range(num_shards)], spec, 0, "t0")
    return ShardedRows(client, spec)


def test_resync_goes_on_from_the_shards_versions_under_a_new_number_and_counts_the_rollback():
    r = rows()
    lane = r.book.lanes[(1, "emb")]
    lane.version, lane.base, lane.wait_for, lane.sequence, lane.unanswered = 7, 7, 8, 5, True
    r.resync(1, {"emb": 4})
    assert (lane.version, lane.base, lane.wait_for, lane.unanswered, lane.resumed) == (4, 4, 4, False, True)
    assert r.counters["versions_lost"] == 3 and r.counters["restarts"] == 1
    assert r.book.lanes[(0, "emb")].version == 0  # the other shard's lanes are untouched


def test_resync_drops_a_failed_push_kept_for_the_restarted_shard_only():
    r = rows()
    r.book.pending["emb"] = pending = type("P", (), {})()
    pending.payloads, pending.done = {0: None, 1: None}, [0]
    r.resync(1, {})
    assert pending.done == [0, 1] and r.counters["pushes_lost"] == 1
    r.resync(1, {})  # a second restart does not count the same push again
    assert r.counters["pushes_lost"] == 1


def test_the_first_push_after_a_resync_that_a_round_answers_duplicate_is_counted_lost():
    r = rows()
    lane = r.book.lanes[(0, "emb")]
    r.resync(0, {"emb": 2})
    assert r.book.push_outcome(lane, "duplicate", attempts=1) == "lost"
    assert r.counters["pushes_lost"] == 1
    assert r.book.push_outcome(lane, "duplicate", attempts=1) == "duplicate"  # only the first after a resync


def test_a_duplicate_on_a_retry_after_a_resync_is_a_lost_reply_not_a_lost_push():
    r = rows()
    r.resync(0, {})
    assert r.book.push_outcome(r.book.lanes[(0, "emb")], "duplicate", attempts=2) == "duplicate"


def test_abandon_drops_the_kept_push_and_gives_the_unfinished_shards_new_numbers(monkeypatch):
    r = rows()

    def fail_on_shard_1(s, table, ids, grads, n):
        lane = r.book.lanes[(s.index, table)]
        lane.sequence += 1
        lane.unanswered = s.index == 1
        if s.index == 1:
            raise ConnectionError("shard 1 did not answer")
        return "applied"

    monkeypatch.setattr(r.pushes, "push_shard", fail_on_shard_1)
    ids = torch.arange(6)
    with pytest.raises(RowsPushFailed):
        r.push("emb", ids, torch.ones(6, 4), 1)
    assert r.abandon("emb") is True
    assert "emb" not in r.book.pending and not r.book.lanes[(1, "emb")].unanswered
    assert r.counters["pushes_abandoned"] == 1
    assert r.abandon("emb") is False  # nothing left to drop


class AbandoningRows(FlakyRows):
    """FlakyRows that records which tables' failed pushes abandon_step() dropped, as ShardedRows.abandon would."""

    def __init__(self, tables, fail):
        super().__init__(tables, fail)
        self.abandoned = []

    def abandon(self, table):
        self.abandoned.append(table)
        return True


def test_abandon_step_after_a_failed_table_push_drops_that_tables_push_in_the_row_client_too():
    model = Tower()
    rows = AbandoningRows([t.spec for t in (model.items, model.users)], fail={"users"})
    runner, client = stepper(model, rows, flat=type("Flat", (), {"zero_grad": lambda self: None})())
    model(torch.tensor([1]), torch.tensor([5]), torch.tensor([0])).sum().backward()
    with pytest.raises(grpc.RpcError):
        runner.step(num_samples=1)
    runner.abandon()
    assert rows.abandoned == ["users"]  # items was pushed: nothing of it is kept
    assert client.counts["table_pushes_abandoned"] == 1 and client.counts["steps_abandoned"] == 1


def test_a_push_with_no_shard_left_to_do_completes_without_a_call():
    """A table push kept from a failed step whose every shard answered since (its todo empty) made map_settled
    index an empty list: IndexError, and both trainers of a MovieLens job exited 1 after a shard's kill -9."""
    client = ShardedClient(["127.0.0.1:1", "127.0.0.1:2"], job(2), 0, "t0")
    try:
        assert client.map_settled(lambda s: 1 / 0, shards=[]) == []
        assert [type(r) for r in client.map_settled(lambda s: 1 / 0, shards=[1])] == [ZeroDivisionError]
    finally:
        client.close()
