"""`ps-server reshard` against three real shards over gRPC on loopback: it drives a 2 -> 3 hand-off of a sync
dense job while the test pushes rounds, and a re-run after it finished resumes from the shards' records."""

import threading

import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.reshard_cmd import Coordinator, reshard_main
from psserver.handoff import MAX_FORWARD_LAG
from tests.integration.test_handoff_io import NEW, NEW_RANGES, OLD, Job, pull

MAX_BEFORE_R = MAX_FORWARD_LAG // 2


def test_ps_server_reshard_moves_a_running_job_to_three_shards_and_a_rerun_resumes_to_done(shard_server, capsys):
    job = Job(shard_server)
    job.rounds(2)
    argv = ["--ps", ",".join(job.old), "--to", ",".join(job.new), "--wait", "120"]
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    before_r = [0, 0]  # rounds pushed before R is known: at most MAX_BEFORE_R, under the forward log's bound, so a
    # copy slowed by a loaded machine is never outrun into copying again for ever (handoff.MAX_FORWARD_LAG)
    while command.is_alive():  # training goes on; pushes only below R (round R-1's replies are not held yet)
        for i in (0, 1):
            R = job.reshard(i, pb.ReshardRequest.STATUS, plan="").round
            version = job.shards[i].stats(fingerprint=OLD.fingerprint).version
            if (not R and before_r[i] < MAX_BEFORE_R) or (R and version < R):
                assert job.push(i, version).outcome == pb.APPLIED
                before_r[i] += not R
        command.join(0.05)  # paces the rounds (a round a shard per turn), not a synchronisation
    assert result["rc"] == 0
    out = capsys.readouterr().out
    assert "committed" in out and "switched" in out and "done: layout 1" in out
    R = job.reshard(0, pb.ReshardRequest.STATUS, plan="").round
    pulled = [pull(s, 1, R, NEW.fingerprint) for s in job.shards]
    assert [(h.version, h.layout_epoch, len(w)) for h, w in pulled] == [(R, 1, b - a) for a, b in NEW_RANGES]
    at_r = torch.cat([pull(s, 0, R, OLD.fingerprint)[1] for s in job.shards[:2]])
    assert torch.equal(torch.cat([w for _, w in pulled]), at_r)

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


def test_ps_server_reshard_that_drains_a_shard_is_a_one_line_cli_error(capsys):
    with pytest.raises(SystemExit) as e:
        reshard_main(["--ps", "127.0.0.1:1,127.0.0.1:2", "--to", "127.0.0.1:1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--to leaves out 127.0.0.1:2" in err and "not built yet" in err
