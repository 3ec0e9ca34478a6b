"""`ps-server reshard` against three real shards over gRPC on loopback: it drives a 2 -> 3 hand-off of a sync
dense job while the test pushes rounds (round R-1's as futures: their replies wait for DECIDE), and a re-run
after it finished resumes from the shards' records; a 3 -> 2 drain, to its last line; and --at-round."""

import socket
import threading

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.errors import LAYOUT_MOVED, REASON_METADATA_KEY
from psserver.protocol.job import TableSpec
from psserver.protocol.proto import ps_pb2 as pb
from psserver.resharding import reshard_cmd
from psserver.resharding.handoff.machine import MAX_FORWARD_LAG
from psserver.resharding.reshard_cmd import Coordinator, reshard_main
from tests.helpers import refused
from tests.integration.test_handoff_drain import Run, grad
from tests.integration.test_handoff_io import NEW, NEW_RANGES, Job, pull, spec

MAX_BEFORE_R = MAX_FORWARD_LAG // 2


def train_while(run, command, shards, at_round=0, follow_to=None) -> list:
    """Push rounds on ``run``'s shards while ``command`` runs: below R only, round R-1's as futures (their replies
    wait for DECIDE; returned, answered), none before ``at_round`` is reached (a plan prepared earlier fails the
    test); ``follow_to``: once every shard names layout 1, follow it there and push on."""
    before_r, held = [0] * len(shards), {}  # rounds pushed before R is known: at most MAX_BEFORE_R, under the
    # forward log's bound (handoff.MAX_FORWARD_LAG): the throttle is tested on its own
    while command.is_alive():
        status = [s.stub.Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=10) for s in shards]
        if follow_to is not None and run.epoch == 0 and all(r.layout_epoch == 1 for r in status):
            run.follow("cmd", follow_to)  # the command waits for round R to close in layout 1 before its last line
        for j in range(len(run.on)):
            reply, version = status[run.on[j]], run.version(j)
            if version < at_round:
                assert not reply.handoffs, f"prepared at version {version}, before --at-round {at_round}"
            if run.epoch or (not reply.round and before_r[j] < MAX_BEFORE_R) or (
                    reply.round and version < reply.round - 1):
                assert run.push(j, version).outcome == pb.APPLIED
                before_r[j] += not reply.round and version >= at_round
            elif reply.round and version == reply.round - 1 and j not in held:
                held[j] = run.push(j, version, later=True)
        command.join(0.05)  # paces the rounds (a round a shard per turn), not a synchronisation
    return [f.result() for f in held.values()]


def test_ps_server_reshard_moves_a_running_job_to_three_shards_and_a_rerun_resumes_to_done(shard_server, capsys):
    shards = [shard_server(shard=i % 3, lease_timeout=0) for i in range(5)]  # 0-2: the job; 3-4: a reference
    run, ref = Run(shards, [0, 1]), Run(shards, [3, 4])
    run.rounds(2)
    old, new = run.addresses([0, 1]), run.addresses([0, 1, 2])
    # --retire-wait 0: this test pushes nothing in layout 1, so round R never closes there (RETIRE at once)
    argv = ["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120", "--retire-wait", "0"]
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    held = train_while(run, command, shards[:3])
    assert result["rc"] == 0
    assert [r.layout_epoch for r in held] == [1, 1]  # round R-1's replies went out after the switch, naming it
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
    argv = ["--ps", ",".join(job.old), "--to", ",".join(job.new), "--wait", "120", "--retire-wait", "0"]
    first = Coordinator(job.old, job.new, say=lambda line: None)  # the same plan id as the command's
    try:
        first.call_all(pb.ReshardRequest.PREPARE)
        first.wait(lambda r: set(p for p in first.phases(r) if p.startswith("source:")) == {"source:tailing"},
                   "every move to tail")
        R = max(first.call(a, pb.ReshardRequest.PROPOSE).proposal for a in job.old)
        first.call_all(pb.ReshardRequest.COMMIT, round=R)
    finally:
        first.close()  # the coordinator "crashed" here
    held = job.rounds(R, held=True)
    assert reshard_main(argv) == 0  # reads R from the shards' records, goes on to the switch
    assert [f.result().layout_epoch for f in held] == [1, 1]
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
    held = train_while(run, command, shards, follow_to=[0, 1])  # pushes below R, then in layout 1
    assert result["rc"] == 0
    assert [r.layout_epoch for r in held] == [1, 1, 1]  # the drained shard's too
    out = capsys.readouterr().out
    assert f"-> {','.join(new)} (drains {old[2]})" in out, out
    assert out.strip().splitlines()[-1] == f"drained {old[2]}: it holds no job state now and may be stopped", out
    assert [s.stats().drained for s in shards] == ["", "", "retired"]
    assert all(p.params is None for p in shards[2].server.layouts._hosts[0].parts)


def test_ps_server_reshard_at_round_prepares_only_once_the_first_shard_reaches_that_round(shard_server, capsys):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1])
    old, new = run.addresses([0, 1]), run.addresses([0, 1, 2])
    argv = ["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120", "--at-round", "4",
            "--retire-wait", "0"]
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    train_while(run, command, shards, at_round=4)  # asserts no plan exists below version 4
    assert result["rc"] == 0 and "done: layout 1" in capsys.readouterr().out
    assert min(side.machine.copied_at for s in shards[:2] for side in s.server.handoffs.sources) >= 4


def push_again(run: Run, j: int, base: int, sequence: int, job) -> pb.PushReply:
    """Layout 0's push of shard ``j`` at ``base`` sent again under its number: a lost reply's retry."""
    (a, b), shard = run.ranges([0, 1])[j], run.shards[j]
    h = shard.header(n=b - a, version=base, sequence=sequence, fingerprint=job.fingerprint)
    h.layout_epoch = 0
    return shard.stub.Push(encode(wire_tensor(grad(base)[a:b], pb.FLOAT32), h, 1024), timeout=10)


def status(shard) -> pb.ReshardReply:
    return shard.stub.Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=10)


def test_ps_server_reshard_retires_once_round_r_closed_in_the_new_layout_so_a_lost_reply_retried_is_duplicate(
        shard_server, capsys):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1])
    run.rounds(2)
    old_job, new = run.job, run.addresses([0, 1, 2])
    argv = ["--ps", ",".join(run.addresses([0, 1])), "--to", ",".join(new), "--wait", "120"]
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    before_r, held = [0, 0], {}
    while not all(status(s).layout_epoch == 1 for s in shards):  # pushes below R, round R-1's as futures
        for i in (0, 1):
            R, version = status(shards[i]).round, run.version(i)
            if (not R and before_r[i] < MAX_BEFORE_R) or (R and version < R - 1):
                assert run.push(i, version).outcome == pb.APPLIED
                before_r[i] += not R
            elif R and version == R - 1 and i not in held:
                held[i] = run.push(i, version, later=True)
        command.join(0.05)  # paces the rounds, not a synchronisation
    assert [f.result().layout_epoch for f in held.values()] == [1, 1]  # released at the switch, naming it
    R = status(shards[0]).round
    # round R-1's push to shard 0, its reply "lost": sent again after the switch, the tombstone still answers it
    again = push_again(run, 0, R - 1, run.seq[(0, 0)], old_job)
    assert (again.outcome, again.version) == (pb.DUPLICATE, R)
    assert command.is_alive()  # waiting for round R in layout 1 before RETIRE: nothing is retired yet
    run.follow("cmd", [0, 1, 2])
    for j in range(3):
        assert run.push(j, R).outcome == pb.APPLIED  # round R closes in layout 1 on every new shard
    command.join(60)
    assert result["rc"] == 0
    out = capsys.readouterr().out
    assert "done: layout 1" in out and "retiring anyway" not in out, out
    e = refused(lambda: push_again(run, 0, R - 1, run.seq[(0, 0)], old_job), grpc.StatusCode.FAILED_PRECONDITION,
                "layout_epoch is 0")  # RETIRE freed layout 0 now
    assert dict(e.trailing_metadata())[REASON_METADATA_KEY] == LAYOUT_MOVED


def test_ps_server_reshard_says_a_refused_prepare_is_refused_again_never_to_run_it_again_to_resume(shard_server,
                                                                                                 capsys):
    """A permanent refusal (an async table cannot move) is the shards' answer: the same command gets it again."""
    job = Job(shard_server, spec(tables=(TableSpec("emb", 4, seed=7, mode="async"),)))
    argv = ["--ps", ",".join(job.old), "--to", ",".join(job.new), "--wait", "60", "--retire-wait", "0"]
    assert reshard_main(argv) == 1
    err = capsys.readouterr().err
    cause, hint = err.splitlines()
    assert cause.startswith("ps-server reshard: ") and "answered PREPARE with FAILED_PRECONDITION" in cause
    assert "table 'emb' mode is async" in cause
    assert hint.startswith("  hint: fix what the refusal names (the same command is refused again)")
    assert "run the same command again" not in err


def test_ps_server_reshard_that_got_no_answer_says_to_run_the_same_command_again_to_resume(monkeypatch, capsys):
    """No answer (nothing listens: UNAVAILABLE) may be a shard restarting or a cut connection: a re-run resumes."""
    monkeypatch.setattr(reshard_cmd, "CALL_RETRY_SECONDS", 0.0)  # no answer: given up at once, not after 30 s
    ports = []
    for _ in range(2):
        with socket.socket() as s:  # a port nothing listens on once closed
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    old, new = [f"127.0.0.1:{ports[0]}"], [f"127.0.0.1:{p}" for p in ports]
    assert reshard_main(["--ps", ",".join(old), "--to", ",".join(new), "--timeout", "10"]) == 1
    err = capsys.readouterr().err
    cause, hint = err.splitlines()
    assert "answered STATUS with UNAVAILABLE" in cause
    assert hint.startswith("  hint: run the same command again to resume")


def test_an_abort_reaches_the_sources_when_the_new_shard_listed_first_does_not_answer(shard_server, monkeypatch,
                                                                                        capsys):
    """The new shard is called first; gone, it used to stop the abort there, and the sources held their plan."""
    monkeypatch.setattr(reshard_cmd, "CALL_RETRY_SECONDS", 0.0)  # no answer: given up at once, not after 30 s
    job = Job(shard_server)
    job.rounds(2)
    first = Coordinator(job.old, job.new, say=lambda line: None)
    try:
        first.call_all(pb.ReshardRequest.PREPARE)
    finally:
        first.close()
    gone = job.new[2]
    job.shards[2].server.stop(grace=0)
    argv = ["--ps", ",".join(job.old), "--to", ",".join(job.new), "--abort", "--timeout", "5"]
    assert reshard_main(argv) == 1
    out, err = capsys.readouterr()
    assert f"abort not taken by {gone}" in out
    cause, hint = err.splitlines()
    assert f"aborted on every shard but {gone}" in cause and "run the same --abort again" in hint
    for i in (0, 1):  # the sources took it: their moves are over (their new pieces dropped) and the old layout trains on
        phases = {h.phase for h in job.reshard(i, pb.ReshardRequest.STATUS).handoffs}
        assert "source:owner" in phases and phases <= set(reshard_cmd.ENDED_ALONE)
    job.rounds(4)


def test_the_same_command_runs_a_plan_again_after_it_was_aborted(shard_server, capsys):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1])
    run.rounds(2)
    old, new = run.addresses([0, 1]), run.addresses([0, 1, 2])
    argv = ["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120", "--retire-wait", "0"]
    first = Coordinator(old, new, say=lambda line: None)  # the same plan id as the command's
    try:
        first.call_all(pb.ReshardRequest.PREPARE)
    finally:
        first.close()
    assert reshard_main([*argv, "--abort"]) == 0
    assert "aborted; the old layout goes on" in capsys.readouterr().out
    result = {}
    command = threading.Thread(target=lambda: result.setdefault("rc", reshard_main(argv)), daemon=True)
    command.start()
    train_while(run, command, shards)
    assert result["rc"] == 0 and "done: layout 1" in capsys.readouterr().out


class _Shards:
    """The STATUS answers of a plan's shards, as the coordinator reads them, and the ops it sends."""

    def __init__(self, plan: str, phases: dict[str, list[str]]):
        self.plan, self.phases, self.sent = plan, phases, []

    def call(self, address, op, **kw):
        self.sent.append((address, pb.ReshardRequest.Op.Name(op), kw.get("switch")))
        return pb.ReshardReply(plan=self.plan, handoffs=[pb.HandoffState(plan=self.plan, phase=p)
                                                         for p in self.phases[address]])


def test_a_coordinator_that_sees_a_shard_end_the_plan_alone_aborts_it_on_every_shard_and_says_so():
    old, new = ["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    coordinator = Coordinator(old, new, say=lambda line: None)
    try:
        fake = _Shards(coordinator.plan, {old[0]: ["source:blocked"], old[1]: ["source:blocked"],
                                          new[2]: ["dest:dropped"]})  # the new piece dropped itself
        coordinator.call = fake.call
        with pytest.raises(reshard_cmd.CoordinatorError, match=r"127.0.0.1:3 ended the plan on its own") as e:
            coordinator.wait(lambda r: False, "every new piece to replay")
        assert "aborted on every shard" in str(e.value) and "starts it afresh" in reshard_cmd.error_hint(e.value)
        decides = [(a, switch) for a, op, switch in fake.sent if op == "DECIDE"]
        assert decides == [(old[0], False), (old[1], False), (new[2], False)]  # sources first
    finally:
        coordinator.close()


class _Clock:
    """A fake clock the coordinator's waits sleep on (no real time passes)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("moving", [False, True])
def test_copies_that_move_no_byte_for_the_stall_end_the_plan_everywhere_and_moving_ones_wait_on(moving):
    old, new = ["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    clock = _Clock()
    coordinator = Coordinator(old, new, say=lambda line: None, stall=5.0, wait=30.0, clock=clock, sleep=clock.sleep)
    try:
        fake = _Shards(coordinator.plan, {a: ["source:copying"] for a in old} | {new[2]: ["dest:receiving"]})
        polls = []

        def call(address, op, **kw):
            reply = fake.call(address, op, **kw)
            if op == pb.ReshardRequest.STATUS:
                polls.append(clock.now)
                for h in reply.handoffs:
                    h.bytes = len(polls) if moving else 0  # a copy that moves a byte a poll, or none
            return reply

        coordinator.call = call
        with pytest.raises(reshard_cmd.CoordinatorError) as e:
            coordinator.wait(lambda r: False, "every move's copy to be acknowledged", copying=True)
        decides = [a for a, op, _ in fake.sent if op == "DECIDE"]
        if moving:  # progress: only --wait ends it, and nothing is aborted by the coordinator
            assert "waited 30 s" in str(e.value) and decides == []
        else:
            assert "moved no byte in 5 s (--stall" in str(e.value) and decides == [*old, new[2]]
            assert clock.now < 30.0
    finally:
        coordinator.close()
