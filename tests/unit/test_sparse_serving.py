"""Per-table decisions on a shard (psserver.sparse.serving), without a network: a fake clock, a membership value."""

import hashlib

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from psserver.admin import format_stats
from psserver.protocol.errors import FutureVersion, InvalidRequest, StaleGradient
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows import errors
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import RowStore, TableSpec
from psserver.sparse.serving import Membership, RowsPush, ServedTable, Tables, UnknownTable
from psserver.state.metrics import ShardMetrics
from psserver.state.stats import StatsSnapshot

DIM = 3
BOTH = Membership(frozenset({0, 1}), started=True)


def job(mode="sync", num_trainers=2, **table):
    spec = TableSpec("emb", DIM, optimizer=SparseOptimizerConfig(table.pop("optimizer", "sgd"), lr=0.5), **table)
    extra = dict(sync_timeout=5.0) if mode == "stale-timeout" else {}
    return JobSpec(mode=mode, num_trainers=num_trainers, num_shards=1, total_params=10, fingerprint="f" * 16,
                   optimizer=OptimizerConfig("sgd", lr=0.1), tables=(spec,), **extra)


def served(mode="sync", **table) -> ServedTable:
    j = job(mode, **table)
    return ServedTable(j.tables[0], j)


def push(rank, ids, grads=None, base=0, n=1, seq=1, trainer_id=None):
    ids = torch.tensor(ids, dtype=torch.int64)
    grads = torch.ones(len(ids), DIM) if grads is None else grads
    return RowsPush(rank, trainer_id or f"t{rank}", base, n, seq, ids, grads)


def digest(t: ServedTable) -> str:
    h = hashlib.sha256()
    t.digest(h)
    return h.hexdigest()


def test_a_sync_round_applies_the_sample_weighted_average_over_the_union_once():
    t = served("sync")
    g0, g1 = torch.full((2, DIM), 2.0), torch.full((2, DIM), 8.0)
    ref = RowStore(t.spec)
    before = ref.lookup(torch.tensor([1, 2, 3]))
    assert t.push(push(0, [1, 2], g0, n=1), BOTH, now=0.0).outcome == "accepted"
    assert t.version == 0 and t.store.version == 0
    r = t.push(push(1, [2, 3], g1, n=3), BOTH, now=0.0)
    assert r.outcome == "applied" and r.version == 1 and t.store.version == 1  # one apply for the round
    rows = t.store.lookup(torch.tensor([1, 2, 3]))
    # id 1: (1*2)/4; id 2: (1*2 + 3*8)/4; id 3: (3*8)/4 -- an id a trainer did not touch counts as zero
    expected = torch.tensor([0.5, 6.5, 6.0])[:, None].expand(3, DIM)
    assert torch.equal(rows, before - 0.5 * expected)


def test_a_round_waits_for_every_live_trainer_and_a_push_for_an_old_round_is_stale():
    t = served("sync")
    t.push(push(0, [1]), BOTH, now=0.0)
    assert t.version == 0 and not t.close_if_due(BOTH, now=100.0)  # sync: no timeout
    t.push(push(1, [1]), BOTH, now=0.0)
    with pytest.raises(StaleGradient, match="base version 0 is 1 behind"):
        t.push(push(0, [1], base=0, seq=2), BOTH, now=0.0)
    assert t.counts["pushes_stale"] == 1


def test_a_trainer_leaving_closes_the_round_the_others_completed():
    t = served("sync")
    t.push(push(0, [1]), BOTH, now=0.0)
    assert t.close_if_due(Membership(frozenset({0})), now=0.0)
    assert t.version == 1 and t.counts["rounds_membership"] == 1


def test_a_stale_timeout_round_closes_at_its_deadline_not_before():
    t = served("stale-timeout")
    t.push(push(0, [1]), BOTH, now=10.0)
    assert t.deadline(BOTH) == 15.0
    assert not t.close_if_due(BOTH, now=14.9) and t.version == 0
    assert t.close_if_due(BOTH, now=15.0) and t.version == 1
    assert t.counts["rounds_timeout"] == 1


def test_the_acknowledged_sequence_again_is_a_duplicate_and_changes_nothing():
    t = served("async")
    assert t.push(push(0, [1, 2]), BOTH, now=0.0).outcome == "applied"
    after = digest(t)
    assert t.push(push(0, [1, 2]), BOTH, now=0.0).outcome == "duplicate"
    assert digest(t) == after and t.counts["pushes_duplicate"] == 1
    with pytest.raises(InvalidRequest, match="sequence is 0"):
        t.push(push(0, [1], seq=0, base=1), BOTH, now=0.0)


def test_async_applies_each_push_as_its_own_step():
    t = served("async")
    for seq in (1, 2):
        assert t.push(push(0, [4], seq=seq, base=seq - 1), BOTH, now=0.0).outcome == "applied"
    assert t.version == 2 and t.store.version == 2


def test_async_max_staleness_drops_only_the_rows_updated_since_the_trainer_read_them():
    t = served("async", max_staleness=0)
    t.push(push(1, [5]), BOTH, now=0.0)  # rank 1 updates row 5: version 1
    r = t.push(push(0, [5, 6], base=0), BOTH, now=0.0)  # rank 0 read both at version 0
    assert (r.outcome, r.rows_applied, r.rows_stale) == ("applied", 1, 1)
    assert t.counts["rows_stale"] == 1 and t.version == 2


def test_async_staleness_within_the_bound_keeps_every_row():
    t = served("async", max_staleness=1)
    t.push(push(1, [5]), BOTH, now=0.0)
    r = t.push(push(0, [5], base=0), BOTH, now=0.0)
    assert (r.rows_applied, r.rows_stale) == (1, 0)


def test_nonfinite_rows_under_skip_fill_the_round_and_a_round_of_skips_takes_no_step():
    t = served("sync")
    nan = torch.full((1, DIM), float("nan"))
    assert t.push(push(0, [1], nan), BOTH, now=0.0, refuse_nonfinite=False).outcome == "skipped"
    assert t.push(push(1, [1], nan), BOTH, now=0.0, refuse_nonfinite=False).outcome == "skipped"
    assert t.version == 1 and t.store.version == 0


@pytest.mark.parametrize("bad,error,fragment", [
    (dict(ids=[1, 1]), errors.DuplicateIds, "appears 2 times"),
    (dict(ids=[100]), errors.IdOutOfRange, "out of range"),
    (dict(grads=torch.ones(1, DIM + 1)), errors.WrongShape, "needs float32 (1, 3)"),
    (dict(grads=torch.full((1, DIM), float("inf"))), errors.NonFinite, "NaN or infinite"),
    (dict(base=4), FutureVersion, "base version is 4"),
])
def test_refused_pushes_change_nothing(bad, error, fragment):
    t = served("sync", num_embeddings=100)
    t.push(push(0, [1]), BOTH, now=0.0)
    before = digest(t)
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        t.push(push(1, bad.get("ids", [2]), bad.get("grads"), base=bad.get("base", 0)), BOTH, now=0.0)
    assert digest(t) == before


def test_state_and_restore_keep_rows_round_and_acknowledgements():
    t = served("sync", optimizer="adam")
    t.push(push(0, [1, 2]), BOTH, now=0.0)
    t.push(push(1, [2, 3]), BOTH, now=0.0)
    t.push(push(0, [7], base=1, seq=2), BOTH, now=0.0)  # an open round
    copy = served("sync", optimizer="adam")
    copy.restore(t.state(), now=0.0)
    assert digest(copy) == digest(t)
    assert copy.push(push(0, [7], base=1, seq=2), BOTH, now=0.0).outcome == "duplicate"


def test_an_unknown_table_is_named_with_the_jobs_tables():
    with pytest.raises(UnknownTable, match="table is 'nope' but the job's tables are 'emb'"):
        Tables.for_job(job()).get("nope")


def test_table_numbers_reach_prometheus_and_ps_server_stats():
    tables = Tables.for_job(job("async"))
    tables.get("emb").push(push(0, [1, 2]), BOTH, now=0.0)
    snap = StatsSnapshot(shard=0, initialized=True, version=0, mode="async", start=0, end=10, live_ranks=[0],
                         counters=tables.counters(), job=None, tables=tables.stats())
    metrics = ShardMetrics(0, lambda: snap)
    text = generate_latest(metrics.registry).decode()
    assert 'psgrpc_table_live_rows{shard="0",table="emb"} 2.0' in text
    assert 'psgrpc_table_pushes_total{outcome="applied",shard="0",table="emb"} 1.0' in text
    reply = pb.StatsReply(shard=0, mode="async", counters=tables.counters())
    table = format_stats(["h:1"], [reply])
    assert any(line.startswith("table emb: live rows") and line.split()[-1] == "2" for line in table.splitlines())


def test_the_refusal_classes_map_to_their_documented_codes():
    assert UnknownTable("x").code == grpc.StatusCode.INVALID_ARGUMENT
    assert errors.TooManyIds("x").code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_only_calls_whose_whole_work_is_small_may_run_on_the_event_loop():
    from psserver.protocol.job import JobSpec
    from psserver.protocol.rows.table import TableSpec
    from psserver.sparse.serving import ServedTable
    spec = TableSpec("t", 16)
    job = JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=0, fingerprint="f", tables=(spec,))
    table = ServedTable(spec, job)
    assert table.small_work(16 * 100, 1 << 16)
    assert not table.small_work((1 << 16) + 16, 1 << 16)  # the call's own rows
    table.store.lookup(torch.arange(5000))  # 5,000 rows in 5,000 slots: a new row grows (copies) the whole table
    assert not table.small_work(16, 1 << 16)


# -- an async table's holes: a trainer's push window (trainer.tables.table_window) sends pushes that overtake each other
def test_an_async_table_applies_an_overtaken_push_once_and_its_retry_is_a_duplicate():
    t = served("async")
    assert t.push(push(0, [1], seq=3), BOTH, now=0.0).outcome == "applied"  # 1 and 2 still on the way
    assert t.push(push(0, [2], seq=1), BOTH, now=0.0).outcome == "applied"  # overtaken: new here
    assert t.push(push(0, [2], seq=1), BOTH, now=0.0).outcome == "duplicate"  # its lost reply's retry
    assert t.push(push(0, [3], seq=2, base=1), BOTH, now=0.0).outcome == "applied"
    assert t.push(push(0, [1], seq=3), BOTH, now=0.0).outcome == "duplicate"
    assert t.version == 3 and t.counts["pushes_applied"] == 3 and t.counts["pushes_duplicate"] == 2
    assert not t.holes


def test_an_async_table_refuses_a_number_older_than_the_window_and_changes_nothing():
    t = served("async")
    t.push(push(0, [1], seq=1), BOTH, now=0.0)
    t.push(push(0, [1], seq=70), BOTH, now=0.0)  # 2..69 skipped: only 7..69 (within 64 of 70) stay holes
    before = digest(t)
    with pytest.raises(InvalidRequest, match="sequence is 6 but rank 0's last acknowledged push to table 'emb' "
                                             "was 70"):
        t.push(push(0, [2], seq=6), BOTH, now=0.0)
    assert digest(t) == before and t.version == 2
    assert t.push(push(0, [2], seq=7), BOTH, now=0.0).outcome == "applied"  # still serves; a hole inside it


def test_a_sync_table_keeps_no_holes_and_refuses_an_older_number():
    t = served("sync", num_trainers=1)
    one = Membership(frozenset({0}), started=True)
    t.push(push(0, [1], seq=2), one, now=0.0)
    with pytest.raises(InvalidRequest, match="sequence is 1"):
        t.push(push(0, [1], seq=1, base=1), one, now=0.0)
    assert t.holes is None


def test_an_async_tables_holes_survive_state_and_restore():
    t = served("async")
    t.push(push(0, [1], seq=3), BOTH, now=0.0)
    copy = served("async")
    copy.restore(t.state(), now=0.0)
    assert digest(copy) == digest(t) and copy.holes == {0: frozenset({1, 2})}
    assert copy.push(push(0, [1], seq=2), BOTH, now=0.0).outcome == "applied"
    old = t.state()
    del old["holes"]  # a checkpoint written before holes were kept
    copy.restore(old, now=0.0)
    assert copy.holes == {}
