"""A live re-shard of an async job under real trainers (stage 8 of docs/design/live-reshard.md; psserver.resharding.handoff.shard_async):
two async ``ps-trainer`` processes train a dense mlp on two ``ps-server`` processes; ``ps-server reshard`` moves the
job to three (the third started empty) while they train; they follow the switch and finish.

An async run is not reproducible, so it is checked by accounting instead of bit for bit: each old shard's stop V is
the number of pushes it applied in layout 0 (one version each), each new shard applied exactly the layout-1 steps
(its version minus R, the same on all three), and every step of every trainer is in one layout, each slot of it
applied once or dropped at the switch (never acknowledged): sum(V) + dropped == 2 x (layout-0 steps).  A push lost
or applied twice breaks the sum.  No timing decides it: the sources hold pushes (refused ``handoff``, sent again by
the trainers) while their forwards catch up and from COMMIT to DECIDE, so the switch falls inside the run.
"""

import grpc

from psserver.protocol import stubs
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stubs import fetch_stat
from psserver.resharding.reshard_cmd import reshard_main
from tests.cluster.test_live_reshard import COMMON, done_line
from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer, wait_all

STEPS = 400
ASYNC = [*COMMON[COMMON.index("--model"):], "--mode", "async"]  # the sync test's flags, async


def stop_version(address: str) -> int:
    """An old shard's stop V: its moves' records (STATUS reads them whatever the plan)."""
    with grpc.insecure_channel(address) as ch:
        reply = stubs.stub(ch).Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS, plan="status"), timeout=10)
    versions = {r.version for r in reply.handoffs if r.phase.startswith("source:")}
    assert len(versions) == 1, reply  # every move of the shard stopped at the same V
    return versions.pop()


def test_two_async_trainers_follow_a_live_2_to_3_reshard_and_every_acknowledged_push_is_applied_once(
        tmp_path, capsys):
    shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(3)]  # the third started empty
    old, new = [s.address for s in shards[:2]], [s.address for s in shards]
    procs = list(shards)
    try:
        procs += [start_trainer(r, ",".join(old), tmp_path / f"live{r}.log", [*ASYNC, "--steps", str(STEPS)])
                  for r in range(2)]
        # both trainers registered first: an async job runs without a trainer still starting, and one that registers
        # after the switch with the old --ps list is refused layout-moved (it must be given the new list)
        wait_until(lambda: all(len(fetch_stat(a).live_ranks) == 2 and fetch_stat(a).version >= 2 for a in old),
                   "both trainers in and the job past version 2", timeout=120)
        rc = reshard_main(["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120"])
        out, err = capsys.readouterr()
        assert rc == 0, out + err
        codes = wait_all(procs[3:], 300)
        assert codes == {"trainer0": 0, "trainer1": 0}, procs[3].log_tail(40) + procs[4].log_tail(40)
        stats = [fetch_stat(a) for a in new]
        stops = [stop_version(a) for a in old]
    finally:
        for p in procs:
            p.kill()
    assert "done: layout 1" in out, out
    R = max(stops)
    assert f"takes over at round {R}" in out, out
    layout1 = [s.version - R for s in stats]  # each new shard's pushes in layout 1
    assert len(set(layout1)) == 1 and layout1[0] > 0, (layout1, out)  # the switch fell inside the run
    for s, n in zip(stats, layout1):
        assert (s.counters["layouts_switched"], s.counters["pushes_applied"]) == (1, n), dict(s.counters)
    done = [done_line(tmp_path / f"live{r}.log") for r in range(2)]
    for d in done:
        assert (d["steps"], d["steps_failed"], d["steps_lost"], d["layouts_followed"]) == (STEPS, 0, 0, 1), d
    dropped = sum(d.get("pushes_dropped_at_switch", 0) for d in done)
    steps_in_layout0 = 2 * STEPS - layout1[0]
    assert sum(stops) + dropped == 2 * steps_in_layout0, (stops, dropped, layout1, done)  # 0 lost, 0 applied twice
    held = sum(s.counters.get("handoff_async_pushes_held", 0) for s in stats)
    print(f"R {R}, stops {stops}, layout-1 steps {layout1[0]}, dropped at the switch {dropped}, pushes held {held}, "
          f"re-routed {[d.get('pushes_rerouted', 0) for d in done]}, retries {[d['retries'] for d in done]}")
