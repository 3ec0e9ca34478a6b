"""Issue 24: a live re-shard of a big sync table must never cost a trainer its lease.  The rows' split and hash run
under the plan's lock for seconds on a 1M-row table; a heartbeat is answered on the event loop, so nothing of the
copy may hold the loop: a Reshard STATUS or GetStats waits for the plan's lock on a thread, and the rows' vote runs
on the state worker whatever the slice.  Three real shards over gRPC on loopback (psserver.resharding.handoff.shard_rows);
measured at 1M rows by docs/bench/handoff/measure_rows_lag.py (docs/design/handoff-io.md, "Heartbeats during a rows copy")."""

import threading

import pytest

from psserver.protocol.proto import ps_pb2 as pb
from psserver.resharding.handoff import shard_rows
from tests.helpers import wait_until
from tests.integration.test_handoff_io import Op, spec
from tests.integration.test_handoff_rows_io import TableJob, moved, table, to_tailing


def heartbeat(job, i):
    return job.shards[i].stub.Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id="t0", fingerprint=job.job.fingerprint),
                                        timeout=60)


def test_heartbeats_and_get_stats_are_answered_while_the_plan_lock_is_held_and_status_waits_off_the_loop(
        shard_server):
    job = TableJob(shard_server, spec(tables=(table(),)))
    job.rounds(2)
    to_tailing(job)
    server = job.shards[0].server
    lock = server.handoffs.lock
    held, release = threading.Event(), threading.Event()

    def hold():  # as a big table's split or hash holds it: on another thread, for as long as the test says
        with lock:
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    status = None
    try:
        assert held.wait(60)
        status = job.shards[0].stub.Reshard.future(pb.ReshardRequest(op=Op.STATUS), timeout=120)
        wait_until(lambda: server.layouts.current.head.counters["handoff_records_off_loop"] >= 1,
                   "STATUS waiting for the plan's lock off the event loop")
        stats = job.shards[0].stub.GetStats.future(pb.StatsRequest(), timeout=120)  # its records wait too
        wait_until(lambda: server.layouts.current.head.counters["handoff_records_off_loop"] >= 2,
                   "GetStats waiting for the plan's lock off the event loop")
        assert heartbeat(job, 0).version == 2  # answered on the loop while the lock is still held
        assert not status.done() and not stats.done()
    finally:
        release.set()
        holder.join(60)
    reply = status.result(timeout=120)  # the plan's records, read once the lock was free
    assert reply.plan and reply.handoffs and all(h.plan == reply.plan for h in reply.handoffs)
    assert stats.result(timeout=120).version == 2 and [h.plan for h in stats.result().handoffs] == \
        [reply.plan] * len(reply.handoffs)


def test_get_stats_callers_waiting_for_the_plans_lock_share_one_read_off_the_loop(shard_server):
    """Before: each GetStats (any peer's, uncapped) or STATUS that met the lock held queued a read of its own on
    asyncio's thread pool -- a flood filled the pool a Handoff's decode also runs on (docs/design/attacks-2026-11-25.md)."""
    job = TableJob(shard_server, spec(tables=(table(),)))
    job.rounds(2)
    to_tailing(job)
    server = job.shards[0].server
    counters = server.layouts.current.head.counters
    held, release = threading.Event(), threading.Event()

    def hold():
        with server.handoffs.lock:
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(60)
        before = counters["handoff_records_reads_off_loop"]
        calls = [job.shards[0].stub.GetStats.future(pb.StatsRequest(), timeout=120) for _ in range(20)]
        wait_until(lambda: counters["handoff_records_off_loop"] >= 20, "20 GetStats waiting for the plan's lock")
        assert counters["handoff_records_reads_off_loop"] == before + 1  # one read on a thread for all 20
        assert heartbeat(job, 0).version == 2
    finally:
        release.set()
        holder.join(60)
    plans = {tuple(h.plan for h in c.result(timeout=120).handoffs) for c in calls}
    assert len(plans) == 1 and (records := plans.pop()) and all(records)  # each got the plan's records


def test_the_rows_vote_runs_on_the_state_worker_not_on_the_event_loop_of_a_small_slice(shard_server, monkeypatch):
    threads = []
    vote = shard_rows.RowsHandoff.vote

    def recorded(self, source, round_):
        threads.append(threading.current_thread().name)
        return vote(self, source, round_)

    monkeypatch.setattr(shard_rows.RowsHandoff, "vote", recorded)
    job = TableJob(shard_server, spec(tables=(table(),)))
    assert all(s.server.runtime.inline() for s in job.shards[:2])  # a small slice: its calls run on the loop
    moved(job)
    assert threads and not [t for t in threads if "loop" in t], threads
    assert all("state" in t for t in threads), threads
