"""Hot standby (docs/standby.md), real processes: an etcd, a shard as two replicas (``ps-server --etcd``), two
trainers naming both (``--ps PRIMARY|STANDBY``).  The primary is killed with SIGKILL, or paused past its lease
and woken, mid-run: the standby takes over with nothing rolled back -- every step made once, no step lost,
and a sync job's trained weights bit-identical to the same job's run without the failure."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from psserver.protocol.stubs import fetch_stat
from tests.cluster.helpers import check_nothing_lost, last_step
from tests.helpers import wait_until
from trainer.local.procs import free_port, start_etcd, start_shard, start_trainer, wait_all

pytestmark = pytest.mark.cluster

STEPS, FAIL_AT = 120, 40
LEASE = 1  # seconds: the standby takes over about this long after the primary stops renewing


@pytest.fixture
def etcd(tmp_path):
    proc = start_etcd(tmp_path / "etcd-data", tmp_path / "etcd.log")
    yield proc
    proc.kill()


MLP = ["--model", "mlp", "--dataset", "mnist5k", "--steps", str(STEPS), "--batch-size", "32"]


def replicas(tmp_path, etcd, job: str, procs: list, checkpoints: bool = False, extra: tuple = ()):
    """Shard 0 as replica a (the primary) and b (its standby), once b is in sync."""
    started = []
    for name in "ab":
        ckpt = ["--checkpoint-dir", str(tmp_path / f"{job}-{name}-ckpt")] if checkpoints else []
        started.append(start_shard(0, tmp_path / f"{job}-{name}.log", port=free_port(), extra_args=[
            "--etcd", etcd.address, "--job-name", job, "--replica", name, "--lease-seconds", str(LEASE), *ckpt,
            *extra]))
        procs.append(started[-1])
    a, b = started
    wait_until(lambda: "caught up" in a.log_path.read_text(), "the standby in sync")
    return a, b


def train(tmp_path, etcd, job: str, mode: str, fail=None, model=MLP, checkpoints: bool = False, extra: tuple = ()):
    """Two trainers running ``model``; ``fail(primary)`` at step ``FAIL_AT``.  Returns (the trainers' final
    metrics, the trained state dict, the replica that finished as primary's stats, the replicas); with
    ``checkpoints`` that replica is stopped (a final checkpoint) before it returns."""
    procs = []
    try:
        a, b = replicas(tmp_path, etcd, job, procs, checkpoints, extra)
        metrics = [tmp_path / f"{job}-t{r}.jsonl" for r in range(2)]
        out = tmp_path / f"{job}-model.pt"
        trainers = [start_trainer(r, f"{a.address}|{b.address}", tmp_path / f"{job}-t{r}.log", [
            "--num-trainers", "2", "--mode", mode, *model, "--no-progress", "--log-every", "1", "--threads", "1",
            "--metrics-file", str(metrics[r])] + (["--output", str(out)] if r == 0 else [])) for r in range(2)]
        procs += trainers
        if fail is not None:
            wait_until(lambda: last_step(metrics[0]) >= FAIL_AT, f"{FAIL_AT} steps before the failure", timeout=300)
            fail(a, b)
        assert wait_all(trainers, 300) == {"trainer0": 0, "trainer1": 0}
        done = [json.loads(m.read_text().splitlines()[-1]) for m in metrics]
        primary = b if not a.alive() else a
        stats = fetch_stat(primary.address)
        if checkpoints:
            assert primary.terminate() == 0
        return done, torch.load(out), stats, (a, b)
    finally:
        for p in procs:
            p.kill()


def test_kill_9_of_a_sync_primary_loses_nothing_and_the_weights_are_bit_identical(tmp_path, etcd):
    done, reference, stats, _ = train(tmp_path, etcd, "ref", "sync")
    check_nothing_lost(done, stats, STEPS)
    done, weights, stats, (a, b) = train(tmp_path, etcd, "kill", "sync", fail=lambda a, b: a.kill())
    check_nothing_lost(done, stats, STEPS)
    assert stats.version == STEPS and stats.counters["replica_promotions"] == 1
    assert reference.keys() == weights.keys()
    for name in reference:
        assert torch.equal(reference[name], weights[name]), name
    assert a.popen.returncode == -signal.SIGKILL
    assert "promoted to primary" in b.log_path.read_text()


@pytest.mark.parametrize("mode", ["async", "stale-timeout"])
def test_kill_9_of_an_async_or_stale_timeout_primary_applies_every_push_exactly_once(tmp_path, etcd, mode):
    """(stale-timeout's deadline, 5 s, is longer than a failover: every round still closes with both pushes.)"""
    model = MLP + (["--sync-timeout", "5"] if mode == "stale-timeout" else [])
    done, _, stats, _ = train(tmp_path, etcd, mode, mode, fail=lambda a, b: a.kill(), model=model)
    check_nothing_lost(done, stats, STEPS)
    # async: one optimizer step a push; stale-timeout: one a round -- none lost, none repeated
    assert stats.version == (2 * STEPS if mode == "async" else STEPS)


def test_a_primary_paused_past_its_lease_is_fenced_when_it_wakes(tmp_path, etcd):
    """SIGSTOP: the standby is promoted while the old primary still holds its connections; SIGCONT: it finds
    itself replaced (its lease lapsed, its shipments refused) and stops with status 3 -- it answers nothing."""
    def pause(a, b):
        a.signal(signal.SIGSTOP)
        wait_until(lambda: "promoted to primary" in b.log_path.read_text(), "the standby's promotion")
        a.signal(signal.SIGCONT)
        assert a.popen.wait(30) == 3  # (before train() asks who is primary: it is gone once fenced)

    done, _, stats, (a, _) = train(tmp_path, etcd, "pause", "sync", fail=pause)
    check_nothing_lost(done, stats, STEPS)
    assert "fenced" in a.log_path.read_text()


def test_ps_cluster_standbys_survive_three_kill_9s_with_nothing_lost_and_the_killed_replicas_rejoin(tmp_path):
    """`ps-cluster --standbys 1 --kill-primary` as a user runs it: shard 0's primary killed, its replica restarted
    as the standby, caught up, and the new primary killed too; shard 1's killed once.  The run finishes every
    step, and the summary's failovers say how long each took and that nothing was lost."""
    from tests.cluster.test_cluster_elastic import run_cluster

    run, steps = tmp_path / "run", 400
    proc = run_cluster(["--shards", "2", "--trainers", "2", "--standbys", "1", "--kill-primary", "0@15,1@30,0@350",
                        "--steps", str(steps), "--straggler-delay", "0.05", "--model", "mlp", "--dataset",
                        "synthetic", "--batch-size", "8", "--device", "cpu", "--run-dir", str(run)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    failovers = summary["failovers"]
    assert [(f["shard"], f["steps_lost"]) for f in failovers] == [(0, 0), (1, 0), (0, 0)], failovers
    assert all(f["round"] >= at and f["seconds"] > 0 for f, at in zip(failovers, (15, 30, 350))), failovers
    assert summary["steps"] == [steps, steps] and summary["steps_lost"] == 0 and summary["rounds"] == steps
    assert summary["pushes_applied"] == 2 * 2 * steps  # both shards, every round's two pushes once
    codes = summary["exit_codes"]
    assert codes["shard0-a"] == codes["shard0-b"] == codes["shard1-a"] == -9, codes  # shard 0 lost both once
    assert codes["shard0-a.2"] == 0 and codes["shard1-b"] == 0, codes
    assert "failovers" in proc.stdout and "0 versions lost" in proc.stdout
    assert summary["replication"]["capture_failures"] == 0 and summary["replication"]["shipments"] > 0


def _pid_of(*runs: tuple[str, ...]) -> int:
    """The pid of the one process whose command line holds each of ``runs`` (arguments in a row)."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if all(b"\0".join(a.encode() for a in run) + b"\0" in argv for run in runs):
            found.append(int(proc.name))
    assert len(found) == 1, found
    return found[0]


def test_ps_cluster_restarts_a_primary_fenced_after_its_lease_lapsed_as_the_standby_with_nothing_lost(tmp_path):
    """A primary whose etcd lease lapses -- a host too loaded to renew it in time, here a SIGSTOP past the lease --
    is replaced by its standby and, when it runs again, finds itself fenced and exits 3.  `ps-cluster` takes
    that as the failover it is: the fenced replica is started again as the standby, the job finishes every
    step, nothing lost, and the summary names the failover as fenced (it stopped the whole run before)."""
    import os
    import threading

    from tests.cluster.test_cluster_elastic import run_cluster

    run, steps, job = tmp_path / "run", 300, f"fence-{tmp_path.name}"
    result = {}
    runner = threading.Thread(target=lambda: result.update(proc=run_cluster(
        ["--shards", "2", "--trainers", "2", "--standbys", "1", "--steps", str(steps), "--straggler-delay", "0.05",
         "--model", "mlp", "--dataset", "synthetic", "--batch-size", "8", "--device", "cpu", "--job-id", job,
         "--run-dir", str(run)], timeout=600)))
    runner.start()
    try:
        wait_until(lambda: (run / "trainer0.jsonl").exists() and last_step(run / "trainer0.jsonl") >= 30,
                   "the job's first 30 steps", timeout=300)
        pid = _pid_of(("--shard", "0"), ("--job-name", job, "--replica", "a"))  # shard 0's primary
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: "promoted to primary" in (run / "shard0-b.log").read_text(), "the standby's promotion")
        os.kill(pid, signal.SIGCONT)
    finally:
        runner.join(timeout=600)
    proc = result["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    failovers = summary["failovers"]
    assert [(f.get("fenced"), f["steps_lost"]) for f in failovers] == [(True, 0)], failovers
    assert summary["steps"] == [steps, steps] and summary["steps_lost"] == 0 and summary["rounds"] == steps
    assert summary["pushes_applied"] == 2 * 2 * steps  # both shards, every round's two pushes once
    codes = summary["exit_codes"]
    assert codes["shard0-a"] == 3 and codes["shard0-a.2"] == 0, codes  # fenced, then started again as the standby
    assert "was fenced" in proc.stdout + proc.stderr


def test_a_killed_standby_is_dropped_and_the_primary_goes_on_alone(tmp_path, etcd):
    """kill -9 of the standby: the primary's shipment times out, etcd records it dropped (so it can never be
    promoted with its old state), and the primary answers alone -- nothing lost, logged."""
    done, _, stats, (a, b) = train(tmp_path, etcd, "nostandby", "sync", fail=lambda a, b: b.kill())
    check_nothing_lost(done, stats, STEPS)
    assert stats.counters["replica_standby_lost"] == 1 and stats.counters["replica_promotions"] == 0
    assert "running unreplicated" in a.log_path.read_text()


def test_with_require_standby_a_lost_standby_holds_every_reply_until_a_new_one_catches_up(tmp_path, etcd):
    """``--require-standby``: kill -9 of the standby makes the primary hold its replies (nothing is acknowledged
    that only it holds; the gauge says unreplicated) until a fresh replica has caught up; then the job finishes
    with nothing lost."""
    extra, fresh = ("--require-standby",), []

    def replace_standby(a, b):
        b.kill()
        wait_until(lambda: "replies wait (--require-standby)" in a.log_path.read_text(), "the primary to hold")
        assert fetch_stat(a.address).counters["replica_unreplicated"] == 1
        held = last_step(tmp_path / "req-t0.jsonl")
        fresh.append(start_shard(0, tmp_path / "req-c.log", port=free_port(), extra_args=[
            "--etcd", etcd.address, "--job-name", "req", "--replica", "c", "--lease-seconds", str(LEASE), *extra]))
        # the new replica took a second or more to start: no step was answered meanwhile (one whose reply had
        # passed the barrier before the loss may still have been written down)
        assert last_step(tmp_path / "req-t0.jsonl") <= held + 1

    try:
        done, _, stats, (a, _) = train(tmp_path, etcd, "req", "sync", fail=replace_standby, extra=extra)
    finally:
        for p in fresh:
            p.kill()
    check_nothing_lost(done, stats, STEPS)
    assert stats.counters["replica_catch_ups"] == 2 and stats.counters["replica_standby_lost"] == 1
    assert stats.counters["replica_unreplicated"] == 0 and stats.counters["replica_promotions"] == 0


def test_training_goes_on_while_etcd_is_down(tmp_path, etcd):
    """etcd killed mid-run: the primary keeps shipping to its standby and answering; only a change of roles
    would wait for etcd (none is needed)."""
    done, _, stats, (a, b) = train(tmp_path, etcd, "noetcd", "sync", fail=lambda a, b: etcd.kill())
    check_nothing_lost(done, stats, STEPS)
    assert stats.counters["replica_promotions"] == 0 and stats.counters["replica_standby_lost"] == 0
    assert a.popen.returncode == b.popen.returncode == -signal.SIGKILL  # both served to the end (the cleanup's kill)


def test_with_a_replica_lag_a_failover_rolls_back_at_most_that_many_rounds_and_counts_them(tmp_path, etcd):
    """``--replica-lag 2``: replies do not wait for the standby while it is at most 2 shipments behind.  A kill -9
    then loses at most 2 rounds; the trainers rejoin the promoted standby as a restored shard, count the rounds
    it lacked in steps_lost, and finish every step."""
    done, _, stats, _ = train(tmp_path, etcd, "lag", "sync", fail=lambda a, b: a.kill(),
                              extra=("--replica-lag", "2"))
    for d in done:
        assert d["event"] == "done" and d["steps"] == STEPS and 0 <= d["steps_lost"] <= 2, d
    # One optimizer step a surviving round: the rounds the standby lacked are not made again (as after a restore
    # from a checkpoint), so the version ends short by at most what the trainers counted lost -- none if nothing was.
    lost = max(d["steps_lost"] for d in done)
    assert STEPS - lost <= stats.version <= STEPS and stats.counters["replica_promotions"] == 1, (lost, stats.version)


MOVIELENS_STEPS = 78  # one epoch: 80,000 training ratings / (2 x 512) a step
MOVIELENS = ["--dataset", "movielens100k", "--model", "mf", "--epochs", "1", "--batch-size", "512"]


def test_kill_9_of_a_primary_serving_sync_tables_keeps_every_row_bit_identical(tmp_path, etcd):
    """MovieLens matrix factorisation: the user and item tables (Adam rows) live on the shard.  After a kill -9 of
    the primary mid-epoch the final rows, their optimizer state and the dense slice equal the run without it."""
    from psserver.state.checkpoint import load_newest

    runs = {}
    for job, fail in (("tref", None), ("tkill", lambda a, b: a.kill())):
        done, _, stats, (a, b) = train(tmp_path, etcd, job, "sync", fail, MOVIELENS, checkpoints=True)
        check_nothing_lost(done, stats, MOVIELENS_STEPS)
        if fail is None:  # (pulls that showed nothing newer than a shipment went out without one of their own)
            assert stats.counters.get("replica_reads_on_shipped", 0) > 0
        state, _ = load_newest(tmp_path / f"{job}-{'b' if fail else 'a'}-ckpt", 0)
        runs[job] = state
    ref, kill = runs["tref"], runs["tkill"]
    assert kill.version == ref.version == MOVIELENS_STEPS
    assert torch.equal(kill.params, ref.params)
    assert set(kill.tables) == set(ref.tables) == {"user", "item", "user_bias", "item_bias"}
    for name in ref.tables:
        for key in ("ids", "rows", "optimizer_state"):
            assert torch.equal(kill.tables[name]["rows"][key], ref.tables[name]["rows"][key]), (name, key)
        assert kill.tables[name]["version"] == ref.tables[name]["version"]


def test_a_big_tables_shipments_carry_the_rows_touched_and_the_promoted_standby_holds_the_table_bit_for_bit(
        tmp_path, etcd):
    """An async table of more rows than a partial shipment needs (PARTIAL_FROM): after the standby's whole first
    state, each push's shipment carries only the rows it touched (replica_shipments_since).  kill -9 of the
    primary: the standby, promoted from its whole state and those shipments, serves the table the primary last
    acknowledged -- the same state digest -- and trains on."""
    from types import SimpleNamespace

    from psserver.protocol.proto import ps_pb2 as pb
    from psserver.sparse.serving import PARTIAL_FROM
    from tests.conftest import P, RawShard
    from tests.integration.test_sparse_rpc import job, pull_rows, push_rows, rows_chunks

    procs = []
    try:
        a, b = replicas(tmp_path, etcd, "bigtable", procs)
        spec = job(mode="async")
        ids = list(range(0, 3 * PARTIAL_FROM, 3))
        with RawShard(SimpleNamespace(address=a.address)) as raw:
            raw.register(spec=spec)
            raw.init(torch.zeros(P), chunk_bytes=1 << 20)
            for start in range(0, len(ids), 20_000):  # every row made (shipped with the first push: a pull that
                pull_rows(raw, ids[start:start + 20_000])  # only made rows waits for no shipment)
            for seq in range(1, 7):
                touched = ids[seq * 100:seq * 100 + 300]
                assert push_rows(raw, rows_chunks(touched, seq=seq, base=seq - 1)).outcome == pb.APPLIED
            digest = raw.digest()
            counters = raw.stats().counters
            assert counters["replica_shipments_since"] >= 5 and counters["replica_shipments_whole"] >= 1
            assert counters.get("replica_whole_resends", 0) == 0
        a.kill()
        wait_until(lambda: "serving" in b.log_path.read_text() and "promoted" in b.log_path.read_text(),
                   "the standby promoted")
        with RawShard(SimpleNamespace(address=b.address)) as raw:
            assert raw.digest() == digest
            assert push_rows(raw, rows_chunks(ids[:10], seq=7, base=6)).outcome == pb.APPLIED
    finally:
        for p in procs:
            p.kill()


def test_replicas_of_a_shard_with_tls_ship_to_each_other_over_mutual_tls(tmp_path, etcd):
    """--tls-cert/--tls-key/--tls-client-ca on both replicas: the standby's replication port serves TLS and takes
    the primary's state only from a certificate of that CA -- the standby catches up, then takes over."""
    import re

    import grpc

    from psserver.protocol.proto import replica_pb2 as _rpb
    from psserver.protocol.proto.replica_pb2_grpc import StandbyStub as grpc_stub

    trustme = pytest.importorskip("trustme")
    ca, cert = trustme.CA(), None
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "replica.cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "replica.key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = ("--tls-cert", str(tmp_path / "replica.cert.pem"), "--tls-key", str(tmp_path / "replica.key.pem"),
           "--tls-client-ca", str(tmp_path / "ca.pem"))
    procs = []
    try:
        a, b = replicas(tmp_path, etcd, "tls", procs, extra=tls)  # (returns once the standby caught up)
        port = re.search(r"replication port (\S+)\)", b.log_path.read_text()).group(1)
        with grpc.insecure_channel(port) as plain:  # the port speaks TLS only: a plaintext shipment never lands
            with pytest.raises(grpc.RpcError) as e:
                grpc_stub(plain).Ship(_rpb.ShipRequest(job="tls", shard=0, epoch=99, shipment=1), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        a.kill()
        wait_until(lambda: "promoted" in b.log_path.read_text(), "the standby promoted")
        assert "Traceback" not in a.log_path.read_text() + b.log_path.read_text()
    finally:
        for p in procs:
            p.kill()


def test_ps_cluster_click_model_with_standbys_ships_its_26_tables_and_loses_no_step_through_a_kill(tmp_path):
    """DLRM on criteo-synth (26 tables, rounds that touch some tables and not others) with a standby a shard, as a
    user runs it: every shipment captured (none dropped a standby), the tables shipped as the rows a round
    touched, and shard 0's primary killed mid-run taken over with no step lost."""
    from tests.cluster.test_cluster_elastic import run_cluster

    run, steps = tmp_path / "run", 24
    proc = run_cluster(["--shards", "2", "--trainers", "2", "--standbys", "1", "--kill-primary", "0@10",
                        "--steps", str(steps), "--model", "dlrm", "--dataset", "criteo-synth", "--device", "cpu",
                        "--run-dir", str(run)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert [(f["shard"], f["steps_lost"]) for f in summary["failovers"]] == [(0, 0)], summary["failovers"]
    assert summary["steps"] == [steps, steps] and summary["steps_lost"] == 0
    shipped = summary["replication"]
    assert shipped["capture_failures"] == 0 and shipped["shipments"] > shipped["shipments_whole"] > 0, shipped
