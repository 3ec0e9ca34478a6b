"""A trainer cut off from the network for longer than the lease: dropped, the other goes on; rejoins on heal."""

import json

import pytest

from tests.cluster.netns import Hosts, firewall_as_others_see_it
from tests.cluster.helpers import last_step
from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer, wait_all

LEASE = 2.0


def test_cut_trainer_is_dropped_after_the_lease_and_rejoins_when_the_link_heals(tmp_path):
    hosts = Hosts(["shard0", "shard1", "trainer0", "trainer1"])
    firewall = firewall_as_others_see_it(hosts.tag)
    hosts.up()
    if hosts.fallback:
        hosts.down()
        pytest.skip(f"{hosts.fallback_reason}: a link cannot be cut on loopback")
    procs = []
    try:
        for i in range(2):
            procs.append(start_shard(i, tmp_path / f"shard{i}.log", host="0.0.0.0", port=7000,
                                     extra_args=["--lease-timeout", str(LEASE), "--insecure"], prefix=hosts.prefix(f"shard{i}")))
        metrics = [tmp_path / f"t{r}.jsonl" for r in range(2)]
        trainers = [start_trainer(r, "shard0:7000,shard1:7000", tmp_path / f"t{r}.log",
                                  ["--num-trainers", "2", "--mode", "sync", "--model", "mlp", "--dataset", "synthetic",
                                   "--steps", "300", "--step-delay", "0.02", "--log-every", "1", "--threads", "1",
                                   "--no-progress", "--metrics-file", str(metrics[r])], prefix=hosts.prefix(f"trainer{r}"))
                    for r in range(2)]
        procs += trainers
        wait_until(lambda: last_step(metrics[1]) >= 20, "20 sync steps with both trainers")
        hosts.set_link("trainer1", up=False)
        cut_at = last_step(metrics[0])
        # in sync mode rank 0 can only go on once rank 1's lease has expired on both shards
        wait_until(lambda: last_step(metrics[0]) >= cut_at + 30, "rank 0 to go on without the cut-off rank 1")
        assert last_step(metrics[1]) <= cut_at + 1
        hosts.set_link("trainer1", up=True)
        assert wait_all(trainers, 240) == {"trainer0": 0, "trainer1": 0}
        for r in range(2):
            done = json.loads(metrics[r].read_text().splitlines()[-1])
            assert done["event"] == "done" and done["steps"] == 300
        rank1 = json.loads(metrics[1].read_text().splitlines()[-1])
        assert rank1["retries"] + rank1["stale_pushes"] + rank1["heartbeat_failures"] > 0
        for i in range(2):
            log = (tmp_path / f"shard{i}.log").read_text()
            assert "rank 1 silent" in log and "dropped from the live set" in log
            assert "rank 1 is heard from again" in log
    finally:
        for p in procs:
            p.kill()
        hosts.down()
    assert firewall_as_others_see_it(hosts.tag) == firewall  # a rule it needed for its bridge is gone again
