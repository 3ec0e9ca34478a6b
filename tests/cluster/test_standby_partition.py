"""Hot standby across a network partition, real processes on their own hosts (network namespaces joined by a
bridge, tests/cluster/netns.py): etcd, shard 0 as replicas a (the primary) and b (its standby), two trainers.

A primary whose cable is pulled keeps running: it can reach neither etcd, nor its standby, nor the trainers.  Its
standby is promoted once the primary's lease lapses, the trainers go on on it, and every push is applied once; when
the cable goes back in, the old primary finds itself replaced and stops (status 3) -- it acknowledged nothing
meanwhile (synchronous replication: no reply without the standby's answer, and the standby was cut off).  A standby
cut off is dropped and the primary goes on alone; plugged back, it catches up again and can take over."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.cluster.helpers import check_nothing_lost, last_step
from tests.cluster.netns import Hosts, firewall_as_others_see_it
from tests.helpers import wait_until
from trainer.local.procs import start_etcd, start_shard, start_trainer, wait_all

pytestmark = pytest.mark.cluster

STEPS, FAIL_AT, PORT, LEASE = 120, 40, 7000, 1
SERVICES = ["etcd", "replica-a", "replica-b", "trainer0", "trainer1"]
STATS = ("import json, sys\nfrom psserver.protocol.stubs import fetch_stat\n"
         "r = fetch_stat(sys.argv[1])\n"
         "print(json.dumps({'version': r.version, 'counters': dict(r.counters)}))\n")


@pytest.fixture
def hosts():
    h = Hosts(SERVICES)
    firewall = firewall_as_others_see_it(h.tag)
    h.up()
    if h.fallback:
        h.down()
        pytest.skip(f"{h.fallback_reason}: a link cannot be cut on loopback")
    try:
        yield h
    finally:
        h.down()
    assert firewall_as_others_see_it(h.tag) == firewall  # the rule it may have needed for its bridge is gone


def stats(hosts: Hosts, address: str) -> SimpleNamespace:
    """A replica's GetStats (its version and counters), asked from a trainer's host (this test's own namespace
    reaches none of them)."""
    out = subprocess.run(hosts.prefix("trainer0") + [sys.executable, "-c", STATS, address], capture_output=True,
                         text=True, timeout=60, check=True)
    return SimpleNamespace(**json.loads(out.stdout))


def run_job(tmp_path, hosts: Hosts, job: str, fail,
            steps: int = STEPS) -> tuple[list[dict], SimpleNamespace, tuple]:
    """Two sync trainers on a replicated shard 0; ``fail(a, b, metrics)`` at step FAIL_AT returns the replica's
    host serving at the end.  Returns the trainers' final metrics, that replica's stats, and the replicas."""
    procs = []
    try:
        etcd = start_etcd(tmp_path / "etcd-data", tmp_path / "etcd.log", host="0.0.0.0", advertise="etcd",
                          prefix=hosts.prefix("etcd"))
        procs.append(etcd)
        replicas = []
        for name in "ab":
            host = f"replica-{name}"
            replicas.append(start_shard(0, tmp_path / f"{host}.log", host="0.0.0.0", port=PORT,
                                        prefix=hosts.prefix(host), extra_args=["--insecure", "--etcd", etcd.address, "--job-name", job,
                                                    "--replica", name, "--lease-seconds", str(LEASE),
                                                    "--advertise-host", host]))
            procs.append(replicas[-1])
        a, b = replicas
        wait_until(lambda: "caught up" in a.log_path.read_text(), "the standby in sync")
        metrics = [tmp_path / f"t{r}.jsonl" for r in range(2)]
        trainers = [start_trainer(r, f"replica-a:{PORT}|replica-b:{PORT}", tmp_path / f"t{r}.log", [
            "--num-trainers", "2", "--mode", "sync", "--model", "mlp", "--dataset", "mnist5k", "--steps", str(steps),
            "--batch-size", "32", "--no-progress", "--log-every", "1", "--threads", "1",
            "--metrics-file", str(metrics[r])], prefix=hosts.prefix(f"trainer{r}")) for r in range(2)]
        procs += trainers
        wait_until(lambda: last_step(metrics[0]) >= FAIL_AT, f"{FAIL_AT} steps before the failure", timeout=300)
        serving = fail(a, b, metrics)
        assert wait_all(trainers, 300) == {"trainer0": 0, "trainer1": 0}
        done = [json.loads(m.read_text().splitlines()[-1]) for m in metrics]
        return done, stats(hosts, f"{serving}:{PORT}"), (a, b)
    finally:
        for p in procs:
            p.kill()


def test_a_primary_cut_off_from_the_network_is_replaced_and_fenced_when_plugged_back(tmp_path, hosts):
    def cut(a, b, metrics):
        hosts.set_link("replica-a", up=False)
        wait_until(lambda: "promoted to primary" in b.log_path.read_text(), "the standby's promotion")
        hosts.set_link("replica-a", up=True)
        assert a.popen.wait(60) == 3  # replaced: it answers nothing more
        return "replica-b"

    done, st, (a, b) = run_job(tmp_path, hosts, "cut-primary", cut)
    check_nothing_lost(done, st, STEPS)
    assert st.version == STEPS and st.counters["replica_promotions"] == 1
    assert "fenced" in a.log_path.read_text()


def test_a_standby_cut_off_is_dropped_and_after_the_link_heals_it_catches_up_and_takes_over(tmp_path, hosts):
    """(A longer job: it must still run when the standby is in sync again -- the primary shuns a standby that
    failed for a few seconds -- for the kill to fall mid-job; a job that ended first ends its standby too.)"""
    steps = 6 * STEPS

    def cut(a, b, metrics):
        hosts.set_link("replica-b", up=False)
        at = last_step(metrics[0])
        wait_until(lambda: last_step(metrics[0]) >= at + 10, "10 steps on the primary alone")
        hosts.set_link("replica-b", up=True)
        caught = a.log_path.read_text().count("caught up")
        wait_until(lambda: a.log_path.read_text().count("caught up") > caught, "the standby in sync again")
        assert last_step(metrics[0]) < steps - 1  # (else the kill below would not fall mid-job)
        a.kill()
        wait_until(lambda: "promoted to primary" in b.log_path.read_text(), "the standby's promotion")
        return "replica-b"

    done, st, (a, b) = run_job(tmp_path, hosts, "cut-standby", cut, steps)
    check_nothing_lost(done, st, steps)
    assert st.version == steps and st.counters["replica_promotions"] == 1


def test_a_primary_cut_off_for_good_is_replaced_and_the_trainers_go_on_without_its_answer(tmp_path, hosts):
    """The cable stays out: no refusal from the old primary tells the trainers; their calls to it find it gone."""
    def cut(a, b, metrics):
        hosts.set_link("replica-a", up=False)
        return "replica-b"

    done, st, (a, b) = run_job(tmp_path, hosts, "lost-primary", cut)
    check_nothing_lost(done, st, STEPS)
    assert st.version == STEPS and st.counters["replica_promotions"] == 1
