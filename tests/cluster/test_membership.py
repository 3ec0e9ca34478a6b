"""A trainer killed with SIGKILL in sync mode: rounds resume within the lease; a restarted trainer rejoins."""

import json
import re

from psserver.protocol.stubs import fetch_stat as stats
from tests.cluster.helpers import last_step
from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer

LEASE = 2.0


def test_killed_trainer_is_dropped_after_its_lease_and_a_restarted_one_rejoins(tmp_path):
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=["--lease-timeout", str(LEASE)])
              for i in range(2)]
    ps = ",".join(s.address for s in shards)
    common = ["--num-trainers", "2", "--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--no-progress",
              "--log-every", "1", "--threads", "1", "--step-delay", "0.02"]
    m0, m1, m1b = tmp_path / "t0.jsonl", tmp_path / "t1.jsonl", tmp_path / "t1b.jsonl"
    procs = []
    try:
        rank0 = start_trainer(0, ps, tmp_path / "t0.log", common + ["--steps", "100000", "--metrics-file", str(m0)])
        rank1 = start_trainer(1, ps, tmp_path / "t1.log", common + ["--steps", "100000", "--metrics-file", str(m1)])
        procs += [rank0, rank1]
        wait_until(lambda: last_step(m1) >= 20, "both trainers to make 20 sync steps")
        rank1.kill()  # SIGKILL: no Leave, no goodbye
        killed_at = last_step(m0)
        # rank 0's rounds resume once rank 1's lease has run out: it keeps making steps alone
        wait_until(lambda: last_step(m0) >= killed_at + 30, "rank 0 to go on without rank 1")
        assert rank0.alive()
        # Rank 1's silence is certain, so each shard dropped it; how often a loaded machine also let rank 0's
        # lease run out for a moment is not, so the count is at least one (tests/unit/test_shard_leases.py
        # has the exact counts on a clock the test holds).
        for s in shards:
            st = stats(s.address)
            assert st.counters["lease_expired"] >= 1 and 1 not in st.live_ranks
            assert re.search(r"rank 1 silent for [\d.]+ s \(lease 2.0 s\): dropped from the live set",
                             s.log_path.read_text())

        # a restarted rank 1 re-registers and trains in sync rounds with rank 0 again
        rank1b = start_trainer(1, ps, tmp_path / "t1b.log", common + ["--steps", "20", "--metrics-file", str(m1b)])
        procs.append(rank1b)
        assert rank1b.popen.wait(120) == 0, rank1b.log_tail()
        done = json.loads(m1b.read_text().splitlines()[-1])
        assert done["event"] == "done" and done["steps"] == 20
        assert rank0.alive()  # so those 20 rounds each had both trainers in them
        for s in shards:
            st = stats(s.address)
            assert st.counters["re_registrations"] == 1  # rank 1b took over rank 1; nobody else registered again
            # sync rounds wait for every live trainer however slow: none closed at a timeout or a quorum
            assert st.counters["rounds_timeout"] == 0 and st.counters["rounds_quorum"] == 0
    finally:
        for p in procs:
            p.kill()
        for s in shards:
            s.kill()
