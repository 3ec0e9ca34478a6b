"""A live re-shard of a stale-timeout job under real trainers (stage 8 of docs/design/live-reshard.md): it moves as a sync
one does (rounds, R, round R-1's replies held).  Two ``ps-trainer``s with a ``--sync-timeout`` far longer than any
round here close every round with both gradients, so the run is reproducible: rank 0's final pull from the three
shards equals, bit for bit, the same job on two shards that never re-sharded."""

import re

import torch

from psserver.protocol.stubs import fetch_stat
from psserver.resharding.reshard_cmd import reshard_main
from tests.cluster.test_live_reshard import STEPS, done_line, run_trainers
from tests.helpers import wait_until
from trainer.local.procs import start_shard, wait_all

STALE = ["--mode", "stale-timeout", "--sync-timeout", "60", "--stale-policy", "scale"]  # (the last --mode wins)


def test_two_stale_timeout_trainers_follow_a_live_2_to_3_reshard_and_end_bit_for_bit_as_a_job_that_never_resharded(
        tmp_path, capsys):
    shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(3)]
    old, new = [s.address for s in shards[:2]], [s.address for s in shards]
    procs = list(shards)
    try:
        procs += run_trainers(tmp_path, "live", ",".join(old), STALE)
        wait_until(lambda: all(fetch_stat(a).version >= 2 for a in old), "the job to pass round 2", timeout=120)
        rc = reshard_main(["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120"])
        out, err = capsys.readouterr()
        assert rc == 0, out + err
        assert wait_all(procs[3:], 300) == {"trainer0": 0, "trainer1": 0}, procs[3].log_tail(40)
        stats = [fetch_stat(a) for a in new]
        ref = [start_shard(i, tmp_path / f"ref_shard{i}.log") for i in range(2)]
        procs += ref
        procs += run_trainers(tmp_path, "ref", ",".join(s.address for s in ref), STALE)
        assert wait_all(procs[-2:], 300) == {"trainer0": 0, "trainer1": 0}, procs[-2].log_tail(40)
    finally:
        for p in procs:
            p.kill()
    R = int(re.search(r"takes over at round (\d+)", out).group(1))
    assert 2 <= R < STEPS, out
    for s in stats:  # layout 1's job on each of the three: rounds R.. each closed once, with both gradients
        c = s.counters
        assert (s.version, c["steps"], c["pushes_applied"], c.get("rounds_timeout", 0)) == (
            STEPS, STEPS - R, 2 * (STEPS - R), 0), dict(c)
    for r in range(2):
        done = done_line(tmp_path / f"live{r}.log")
        assert (done["steps"], done["steps_failed"], done["steps_lost"], done["layouts_followed"]) == (
            STEPS, 0, 0, 1), done
    got, want = torch.load(tmp_path / "live.pt"), torch.load(tmp_path / "ref.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the job that never re-sharded"
