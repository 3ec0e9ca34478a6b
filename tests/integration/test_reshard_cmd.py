"""`ps-server reshard` against three real shards over gRPC on loopback: it drives a 2 -> 3 hand-off of a sync
dense job while the test pushes rounds, and a re-run after it finished resumes from the shards' records; and a
3 -> 2 drain, to its last line."""

import threading

import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.reshard_cmd import Coordinator, reshard_main
from psserver.handoff import MAX_FORWARD_LAG
from tests.integration.test_handoff_drain import Run
from tests.integration.test_handoff_io import NEW, NEW_RANGES, Job, pull

MAX_BEFORE_R = MAX_FORWARD_LAG // 2


def test_ps_server_reshard_moves_a_running_job_to_three_shards_and_a_rerun_resumes_to_done(shard_server, capsys):
    shards = [shard_server(shard=i % 3, lease_timeout=0) for i in range(5)]  # 0-2: the job; 3-4: a reference
    run, ref = Run(shards, [0, 1]), Run(shards, [3, 4])
    run.rounds(2)
    old, new = run.addresses([0, 1]), run.addresses([0, 1, 2])
    argv = ["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120"]
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    before_r = [0, 0]  # rounds pushed before R is known: at most MAX_BEFORE_R, under the forward log's bound, so a
    # copy slowed by a loaded machine is never outrun into copying again for ever (handoff.MAX_FORWARD_LAG)
    while command.is_alive():  # training goes on; pushes only below R (round R-1's replies are not held yet)
        for i in (0, 1):
            R = shards[i].stub.Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=10).round
            version = run.version(i)
            if (not R and before_r[i] < MAX_BEFORE_R) or (R and version < R):
                assert run.push(i, version).outcome == pb.APPLIED
                before_r[i] += not R
        command.join(0.05)  # paces the rounds (a round a shard per turn), not a synchronisation
    assert result["rc"] == 0
    out = capsys.readouterr().out
    assert "committed" in out and "switched" in out and "done: layout 1" in out and "drained" not in out
    R = shards[0].stub.Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=10).round
    pulled = [pull(s, 1, R, NEW.fingerprint) for s in shards[:3]]
    assert [(h.version, h.layout_epoch, len(w)) for h, w in pulled] == [(R, 1, b - a) for a, b in NEW_RANGES]
    ref.rounds(R)  # the same rounds on two shards that never re-sharded
    assert torch.equal(torch.cat([w for _, w in pulled]), ref.weights(R))

    assert reshard_main(argv) == 0  # stateless: a re-run reads the shards' records and finds the job done
    assert "done: layout 1" in capsys.readouterr().out


def test_ps_server_reshard_resumes_a_plan_a_crashed_coordinator_left_committed(shard_server, capsys):
    job = Job(shard_server)
    job.rounds(2)
    argv = ["--ps", ",".join(job.old), "--to", ",".join(job.new), "--wait", "120"]
    first = Coordinator(job.old, job.new, say=lambda line: None)  # the same plan id as the command's
    try:
        first.call_all(pb.ReshardRequest.PREPARE)
        first.wait(lambda r: set(p for p in first.phases(r) if p.startswith("source:")) == {"source:tailing"},
                   "every move to tail")
        R = max(first.call(a, pb.ReshardRequest.PROPOSE).proposal for a in job.old)
        first.call_all(pb.ReshardRequest.COMMIT, round=R)
    finally:
        first.close()  # the coordinator "crashed" here
    job.rounds(R)
    assert reshard_main(argv) == 0  # reads R from the shards' records, goes on to the switch
    out = capsys.readouterr().out
    assert f"round {R}" in out and "done: layout 1" in out
    assert [pull(s, 1, R, NEW.fingerprint)[0].layout_epoch for s in job.shards] == [1, 1, 1]


def test_ps_server_reshard_drains_a_shard_prints_the_drain_and_exits_0_once_every_move_is_retired(shard_server,
                                                                                                capsys):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1, 2])
    run.rounds(2)
    old, new = run.addresses([0, 1, 2]), run.addresses([0, 1])
    argv = ["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120"]
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    before_r = [0, 0, 0]
    while command.is_alive():  # training goes on, pushes only below R (as above), then in layout 1
        status = [s.stub.Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=10) for s in shards]
        if run.epoch == 0 and all(r.layout_epoch == 1 for r in status):
            run.follow("cmd", [0, 1])  # the command waits for round R to close in layout 1 before its last line
        for j in range(len(run.on)):
            R, version = status[j].round, run.version(j)
            if run.epoch or (not R and before_r[j] < MAX_BEFORE_R) or (R and version < R):
                assert run.push(j, version).outcome == pb.APPLIED
                before_r[j] += not R
        command.join(0.05)  # paces the rounds, not a synchronisation
    assert result["rc"] == 0
    out = capsys.readouterr().out
    assert f"-> {','.join(new)} (drains {old[2]})" in out, out
    assert out.strip().splitlines()[-1] == f"drained {old[2]}: it holds no job state now and may be stopped", out
    assert [s.stats().drained for s in shards] == ["", "", "retired"]
    assert all(p.params is None for p in shards[2].server.layouts._hosts[0].parts)
