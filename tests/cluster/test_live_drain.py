"""Draining a shard under real trainers (issue 24 item 4, docs/design/handoff-io.md): two sync ``ps-trainer`` processes
train a dense mlp on two ``ps-server`` processes; ``ps-server reshard`` grows the job to three (the third started
empty) and then drains it back to two while they train.  After the second RETIRE the third shard holds no job
state and is stopped with SIGTERM (exit code 0); the trainers follow both switches and finish, and the
parameters, pulled from the two shards in layout 2, equal bit for bit those of the same job on two shards that
never re-sharded.

No timing decides the outcome: each command starts once the shards are past a round (waited for), and round
R-1's replies wait for the switch (then name the new layout, so no step is refused or retried: asserted).  The
trainers are not paced, as in tests/cluster/test_live_reshard.py: a source whose copy is outrun throttles its
rounds.  STEPS leaves both hand-offs room inside the run (asserted).
"""


import torch

from psserver.protocol.stubs import fetch_stat
from tests.cluster.helpers import live_reshard, reshard_shards
from tests.cluster.test_live_reshard import done_line, reference, run_trainers
from tests.helpers import wait_until
from trainer.local.procs import wait_all

STEPS = 320  # unpaced: both R must fall inside the run (asserted)


def test_two_sync_trainers_follow_a_live_2_to_3_to_2_reshard_the_drained_shard_stops_with_0_and_the_model_is_exact(
        tmp_path, capsys):
    shards = reshard_shards(tmp_path)
    two, three = [s.address for s in shards[:2]], [s.address for s in shards]
    procs = list(shards)
    try:
        procs += run_trainers(tmp_path, "live", ",".join(two), [], STEPS)
        wait_until(lambda: all(fetch_stat(a).version >= 2 for a in two), "the job to pass round 2", timeout=120)
        R1, _ = live_reshard(capsys, two, three)
        wait_until(lambda: all(fetch_stat(a).version >= R1 + 2 for a in three), "layout 1 to pass R + 2",
                   timeout=120)
        R2, out = live_reshard(capsys, three, two)
        assert f"(drains {three[2]})" in out and out.strip().splitlines()[-1] == (
            f"drained {three[2]}: it holds no job state now and may be stopped"), out
        assert fetch_stat(three[2]).drained == "retired"
        assert shards[2].terminate() == 0, shards[2].log_tail()  # SIGTERM: it may be stopped, and stops cleanly
        codes = wait_all(procs[3:], 300)
        assert codes == {"trainer0": 0, "trainer1": 0}, procs[3].log_tail(40) + procs[4].log_tail(40)
        stats = [fetch_stat(a) for a in two]
    finally:
        for p in procs:
            p.kill()
    assert 2 <= R1 < R2 < STEPS, (R1, R2)  # both switches fell inside the run: the trainers had to follow them
    for s in stats:  # layout 2's job on each of the two: from R2 to the end, each round applied once
        c = s.counters
        assert (s.version, s.drained, c["steps"], c["pushes_applied"]) == (
            STEPS, "", STEPS - R2, 2 * (STEPS - R2)), dict(c)
    for r in range(2):
        done = done_line(tmp_path / f"live{r}.log")
        assert (done["layouts_followed"], done["layout_fetches"], done["retries"], done.get("pushes_rerouted", 0)) == (
            2, 2, 0, 0), done  # round R-1's replies named each new layout: no step refused, retried or re-routed
        assert (done["steps"], done["versions"], done["steps_failed"], done["steps_lost"]) == (
            STEPS, [STEPS] * 2, 0, 0), done
    got, want = torch.load(tmp_path / "live.pt"), reference(tmp_path, STEPS)  # rank 0's final pull, in layout 2
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the job that never re-sharded"
