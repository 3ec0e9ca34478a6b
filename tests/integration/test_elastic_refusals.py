"""Refusals of the elastic-job fields over real gRPC: a join to a job that admits none or is full, a commit
from the future or already served, a joiner's push before its round -- each one status, a message naming the
field and both values, the shard's state digest unchanged, and the shard still serving."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until

ELASTIC = make_spec(num_trainers=1, max_trainers=2)


def join(shard, spec=ELASTIC, join_round=0, rank=0, trainer_id="joiner", confirm=False):
    return shard.stub.Register(pb.RegisterRequest(rank=rank, trainer_id=trainer_id, job=spec.to_proto(), join=True,
                                                  join_round=join_round, join_confirm=confirm), timeout=10)


@pytest.fixture
def running(shard_server):
    """An elastic sync shard (1 trainer, up to 2) after one applied round."""
    shard = shard_server()
    shard.register(spec=ELASTIC)
    shard.init(torch.randn(P, generator=torch.Generator().manual_seed(1)))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED
    return shard


def still_serves(shard, version):
    assert shard.push(torch.ones(P), version=version).outcome == pb.APPLIED


def test_a_join_to_a_job_that_admits_none_is_failed_precondition(shard_server):
    shard = shard_server()
    shard.register()
    shard.init(torch.zeros(P))
    refused(lambda: join(shard, make_spec()), grpc.StatusCode.FAILED_PRECONDITION,
            "max_trainers is 0 (num_trainers 1)", unchanged=shard)
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED


def test_a_join_to_a_full_job_is_resource_exhausted(running):
    assert join(running).rank == 1
    refused(lambda: join(running, trainer_id="another"), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max_trainers 2", "2 members", unchanged=running)
    still_serves(running, 1)


def test_a_commit_from_the_future_is_out_of_range(running):
    join(running)
    refused(lambda: join(running, join_round=9, rank=1), grpc.StatusCode.OUT_OF_RANGE,
            "join_round is 9 but shard 0 is at version 1: at most 4", unchanged=running)
    still_serves(running, 1)


def test_a_commit_of_a_round_already_served_is_failed_precondition(running):
    refused(lambda: join(running, join_round=1, rank=1), grpc.StatusCode.FAILED_PRECONDITION,
            "join_round is 1 but shard 0 is at version 1", unchanged=running)
    still_serves(running, 1)


def test_a_joiner_is_admitted_from_its_round_and_a_push_before_it_is_refused(running):
    proposal = join(running).join_round
    assert proposal == 3
    still_serves(running, 1)  # the open round closes as usual; round 2 is held until the commit
    reply = join(running, join_round=proposal, rank=1)
    assert reply.membership_epoch == 1 and reply.rank == 1
    assert join(running, join_round=proposal, rank=1) == reply  # a retried commit is answered the same
    join(running, join_round=proposal, rank=1, confirm=True)  # every shard took it: round 2 may close
    refused(lambda: running.push(torch.ones(P), rank=1, trainer_id="joiner", version=2),
            grpc.StatusCode.FAILED_PRECONDITION, "base version is 2 but rank 1 is a member of this job from round 3",
            unchanged=running)
    still_serves(running, 2)
    epochs = running.stub.GetStats(pb.StatsRequest(), timeout=10).epochs
    assert [(e.round, list(e.members)) for e in epochs] == [(0, [0]), (3, [0, 1])]


def test_the_state_digest_changes_with_a_pending_join_and_a_committed_epoch(running):
    """The refusals above assert the digest unchanged: that means something only if it covers the membership
    timeline and the pending joins (which hold rounds), not just the parameters."""
    before = running.digest()
    proposal = join(running).join_round
    pending = running.digest()
    assert pending != before, "a pending join (it holds the job's rounds) is not in the state digest"
    join(running, join_round=proposal, rank=1)
    assert running.digest() not in (before, pending), "a new membership epoch is not in the state digest"


def test_a_push_from_a_joiner_that_has_not_committed_is_failed_precondition(running):
    """Admitted but not committed, a joiner is in no epoch: its gradient must not enter a round (it did, and was
    averaged into the job's weights, from anyone who asked to join and never committed)."""
    assert join(running).rank == 1
    refused(lambda: running.push(torch.full((P,), 1000.0), rank=1, trainer_id="joiner", version=1),
            grpc.StatusCode.FAILED_PRECONDITION, "rank 1 is in no membership epoch of this job",
            "join_round", unchanged=running)
    still_serves(running, 1)
    version, weights = running.pull(min_version=2)
    assert version == 2 and torch.isfinite(weights).all() and weights.abs().max() < 100


def test_a_join_to_a_shard_without_a_job_is_failed_precondition_and_creates_no_partition_or_reservation(
        shard_server):
    shard = shard_server()
    spec = make_spec(num_trainers=1, max_trainers=2, partitions=4)
    request = pb.RegisterRequest(rank=0, trainer_id="joiner", job=spec.to_proto(), join=True, partition=3)
    refused(lambda: shard.stub.Register(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
            "runs no job to join", unchanged=shard)
    stats = shard.stats()
    assert stats.partitions == 1 and stats.counters["memory_reserved_bytes"] == 0
    shard.register(spec=ELASTIC)  # the job that comes next is planned and served as it is
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED and shard.stats().partitions == 1


def test_a_dropped_join_does_not_expel_the_member_that_registered_its_rank_meanwhile(shard_server):
    """A joiner dies between admission and commit; its rank is then registered by a trainer of its own (a plain
    Register).  Dropping the dead join at its deadline must drop only what the joiner made, not that member."""
    shard = shard_server(lease_timeout=1.0)
    spec = make_spec(mode="async", num_trainers=1, max_trainers=3)
    shard.register(spec=spec)
    shard.init(torch.zeros(P))
    assert join(shard, spec, trainer_id="ghost").rank == 1
    shard.register(rank=1, spec=spec, trainer_id="real")
    wait_until(lambda: shard.stats().counters["joins_abandoned"] == 1, "the ghost's join to be dropped")
    version = shard.stats().version
    assert shard.push(torch.ones(P), rank=1, trainer_id="real", version=version).outcome == pb.APPLIED


def test_a_join_before_the_job_is_failed_precondition_with_the_no_job_reason_and_the_job_then_starts(shard_server):
    """A joiner that reaches a shard before rank 0 registered the job: refused, changing nothing, with the
    reason a joiner waits on (trainer.channels.client.register_retry) -- and rank 0 then starts the job as usual."""
    from psserver.protocol.rules import refused_no_job

    shard = shard_server()
    error = refused(lambda: join(shard), grpc.StatusCode.FAILED_PRECONDITION, "runs no job to join",
                    unchanged=shard)
    assert refused_no_job(error)
    shard.register(spec=ELASTIC)
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED
    assert join(shard).rank == 1


def test_other_join_refusals_carry_no_no_job_reason(shard_server):
    from psserver.protocol.rules import refused_no_job

    shard = shard_server()
    shard.register()
    error = refused(lambda: join(shard, make_spec()), grpc.StatusCode.FAILED_PRECONDITION, "max_trainers is 0")
    assert not refused_no_job(error)


def test_a_join_to_a_job_that_ended_carries_the_job_ended_reason_and_changes_nothing(running):
    from psserver.protocol.rules import refused_job_ended, refused_no_job

    running.stub.Leave(pb.LeaveRequest(rank=0, trainer_id="t0", fingerprint="f" * 16), timeout=10)
    before = running.stats()  # no member is left to ask for a digest: the public state then
    error = refused(lambda: join(running), grpc.StatusCode.FAILED_PRECONDITION, "job ended (every trainer left)")
    assert refused_job_ended(error) and not refused_no_job(error)
    after = running.stats()
    assert (after.version, list(after.live_ranks), after.epochs) == (before.version, [], before.epochs)
    running.register(spec=ELASTIC)  # a new job starts as usual
    running.init(torch.zeros(P))
    assert running.push(torch.ones(P)).outcome == pb.APPLIED


def test_a_ps_trainer_joining_a_job_that_ended_exits_0_with_one_line(shard_server, tmp_path):
    """A Deployment's replica that outlives rank 0's Job: the real ps-trainer --join finds the job ended,
    prints why and exits 0 at once (it does not wait --connect-timeout), so the replica completes."""
    from trainer.local.procs import start_trainer, wait_all

    shard = shard_server()
    shard.register(spec=ELASTIC)
    shard.stub.Leave(pb.LeaveRequest(rank=0, trainer_id="t0", fingerprint="f" * 16), timeout=10)
    joiner = start_trainer(None, shard.server.address, tmp_path / "joiner.log",
                           ["--join", "--num-trainers", "1", "--max-trainers", "2", "--connect-timeout", "600",
                            "--model", "mlp", "--dataset", "synthetic", "--steps", "5", "--no-progress",
                            "--threads", "1", "--device", "cpu"], name="joiner")
    try:
        codes = wait_all([joiner], 300)
    finally:
        joiner.kill()
    log = (tmp_path / "joiner.log").read_text()
    assert codes == {"joiner": 0}, log
    assert "ps-trainer: the job has ended; nothing to join: shard 0 at" in log, log
    assert "job ended (every trainer left)" in log and "Traceback" not in log, log


def test_a_commit_holds_the_round_before_its_join_round_until_the_joiners_confirm(running):
    """Another shard may refuse the commit (it restarted and served the join round): until the confirm says every
    shard took it, this one must not serve the join round with the joiner in (docs/design/elastic-join.md)."""
    proposal = join(running).join_round
    still_serves(running, 1)
    join(running, join_round=proposal, rank=1)
    assert running.push(torch.ones(P), version=2).outcome == pb.ACCEPTED  # round 2 is complete but held
    assert running.stats().version == 2
    join(running, join_round=proposal, rank=1, confirm=True)
    assert running.pull(min_version=3)[0] == 3  # the confirm closes it
    assert running.stats().counters["joins_confirmed"] == 1


def test_a_confirm_of_a_round_already_served_is_failed_precondition(running):
    """A shard that restarted after the commit (without it) and served the join round cannot take the confirm."""
    join(running)
    refused(lambda: join(running, join_round=1, rank=1, confirm=True), grpc.StatusCode.FAILED_PRECONDITION,
            "join_round is 1 but shard 0 is at version 1", unchanged=running)
    still_serves(running, 1)


def test_a_joiner_refused_at_its_admission_sends_no_leave_in_another_ranks_name(running):
    from trainer.stepping.api import connect
    from trainer.workloads.models import build_model

    model = build_model("mlp", (1, 28, 28), seed=0)
    with pytest.raises(Exception, match="mode is 'async' but the job has 'sync'"):  # the flags do not match the job
        connect(running.server.address, model, mode="async", max_trainers=4, join=True, connect_timeout=10)
    c = running.stats().counters
    refused_calls = {k: v for k, v in c.items() if k.startswith("refused_")}
    assert refused_calls == {"refused_FAILED_PRECONDITION": 1}, refused_calls  # its join's: no Leave as rank 0
    assert c.get("leaves", 0) == 0
    assert list(running.stats().live_ranks) == [0]  # rank 0, the running trainer, is still in the job
    still_serves(running, 1)


def test_a_joiner_need_not_repeat_the_jobs_initial_trainer_count(running):
    """Issue 35 item 9: a joiner started with --num-trainers at its default against a job started with another
    count was refused "num_trainers is 1 but the job has 2" (with the hint to check the --ps addresses); the count
    is the job's, and a joiner's other flags are still compared."""
    other = dataclasses.replace(ELASTIC, num_trainers=2)  # (at most its max_trainers, 2)
    assert join(running, spec=other).rank == 1
    refused(lambda: join(running, spec=dataclasses.replace(other, mode="async"), trainer_id="another"),
            grpc.StatusCode.FAILED_PRECONDITION, "mode is 'async' but the job has 'sync'", unchanged=running)
    still_serves(running, 1)
