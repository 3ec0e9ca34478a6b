"""A live re-shard of an async job (stage 8 of docs/design/live-reshard.md; psserver.resharding.handoff.shard_async): three real shards
over gRPC on loopback, the test as the coordinator and as the trainer.  SGD at lr 1 with integer gradients and
integer weights, so every parameter is exact in fp32: the final weights on the new layout must equal the initial
ones minus the sum of every acknowledged push, each counted once, whichever layout acknowledged it."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.errors import REASON_METADATA_KEY
from psserver.protocol.job import OptimizerConfig
from psserver.protocol.layouts import new_job
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P
from tests.helpers import refused, wait_until
from tests.integration.test_handoff_io import NEW_RANGES, OLD_RANGES, pull, spec

Op = pb.ReshardRequest


def async_spec(**kw):
    """test_handoff_io's two-shard job, async, SGD at lr 1 (the weights are then computable from the pushes)."""
    return dataclasses.replace(spec("async"), **{"optimizer": OptimizerConfig("sgd", lr=1.0), **kw})


OLD = async_spec()
NEW = new_job(OLD, 3)


class AsyncJob:
    """Two shards running an async job for rank 0, plus an empty third.  ``want`` is the whole flat vector as the
    acknowledged pushes make it: the initial weights minus every APPLIED gradient, each once."""

    def __init__(self, shard_server, job=OLD):
        self.job = job
        self.shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
        for s in self.shards:  # a held reply waits for DECIDE, however slow the machine, not for the timeout
            s.server.handoffs.timeout = 60.0
        self.old = [s.server.address for s in self.shards[:2]]
        self.new = [s.server.address for s in self.shards]
        self.seq, self.gen = {}, torch.Generator().manual_seed(0)
        self.want = torch.randint(-50, 50, (P,), generator=self.gen).float()
        for i, (a, b) in enumerate(OLD_RANGES):
            self.shards[i].register(spec=job, expected_shard=i)
            h = self.shards[i].header(n=b - a, fingerprint=job.fingerprint)
            assert self.shards[i].stub.Init(encode(wire_tensor(self.want[a:b], pb.FLOAT32), h, 1024),
                                            timeout=10).accepted

    def push(self, i, base=None, layout=0, again=None, later=False):
        """A new push (the next number) of an integer gradient, or ``again`` = (number, gradient) sent again;
        booked into ``want`` when APPLIED.  Returns (reply or future, number, gradient)."""
        a, b = (NEW_RANGES if layout else OLD_RANGES)[i]
        if again is None:
            self.seq[(i, layout)] = self.seq.get((i, layout), 0) + 1
            again = (self.seq[(i, layout)], torch.randint(-3, 4, (b - a,), generator=self.gen).float())
        number, grad = again
        if base is None:
            base = self.version(i, layout)
        h = self.shards[i].header(n=b - a, version=base, sequence=number,
                                  fingerprint=NEW.fingerprint if layout else self.job.fingerprint)
        h.layout_epoch = layout
        call = self.shards[i].stub.Push.future if later else self.shards[i].stub.Push
        reply = call(encode(wire_tensor(grad, pb.FLOAT32), h, 1024), timeout=60 if later else 10)
        if not later:
            self.book(reply, a, grad)
        return reply, number, grad

    def book(self, reply, a, grad):
        if reply.outcome == pb.APPLIED:
            self.want[a:a + grad.numel()] -= grad

    def version(self, i, layout=0):
        return self.shards[i].stats(fingerprint=NEW.fingerprint if layout else self.job.fingerprint).version

    def pushes(self, i, n):
        for _ in range(n):
            assert self.push(i)[0].outcome == pb.APPLIED

    def reshard(self, i, op, plan="p1", **kw):
        return self.shards[i].stub.Reshard(pb.ReshardRequest(op=op, plan=plan, old_addresses=self.old,
                                                             new_addresses=self.new, you=self.new[i], **kw),
                                           timeout=10)

    def phases(self):
        return [r.phase for i in range(3) for r in self.reshard(i, Op.STATUS).handoffs]

    def digest(self, i, fingerprint=None):
        return self.shards[i].digest(fingerprint=fingerprint or self.job.fingerprint)

    def committed(self) -> list[int]:
        """PREPARE (the destination first), pushes during the copy, every move tailing, COMMIT: each old shard's
        stop V (they differ: the shards took different numbers of pushes)."""
        self.pushes(0, 3)
        self.pushes(1, 5)
        for i in (2, 0, 1):
            self.reshard(i, Op.PREPARE)
        self.pushes(0, 2)  # during the copy: each applied push is a forward
        self.pushes(1, 4)
        wait_until(lambda: all(p in ("source:tailing", "dest:replaying") for p in self.phases())
                   and len(self.phases()) == 7, "every move to tail and every new piece to replay")
        assert [self.reshard(i, Op.PROPOSE).proposal for i in (0, 1)] == [0, 0]  # async: nothing to hold
        replies = [self.reshard(i, Op.COMMIT, round=0) for i in range(3)]
        return [r.round for r in replies[:2]]


class _Shard:
    """What ``refused(unchanged=...)`` reads: shard ``i``'s state digest (the newest layout's), asked as a member."""

    def __init__(self, job, i, fingerprint=None):
        self.job, self.i, self.fingerprint = job, i, fingerprint

    def digest(self):
        return self.job.digest(self.i, self.fingerprint)


def test_an_async_job_moves_2_to_3_with_pushes_during_the_copy_and_every_acknowledged_push_is_applied_once(
        shard_server):
    job = AsyncJob(shard_server)
    stops = job.committed()
    assert stops == [5, 9]  # each source stopped at its own version
    # after the stop: a new push is held (refused handoff, state unchanged) and a lost reply's retry is DUPLICATE
    held, number, grad = job.push(0, later=True)
    error = held.exception(timeout=10)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "stopped applying pushes at version 5" in error.details()
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "handoff"
    assert job.push(1, again=(job.seq[(1, 0)], torch.zeros(OLD_RANGES[1][1] - OLD_RANGES[1][0])))[0].outcome \
        == pb.DUPLICATE
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every source to vote")
    assert job.shards[0].stats(fingerprint=OLD.fingerprint).counters["handoff_async_pushes_held"] == 1

    R = max(stops)
    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=True, round=R).layout_epoch == 1
    assert [job.version(i, layout=1) for i in range(3)] == [R] * 3  # every new piece starts at the largest stop
    # the held push sent again under its number: layout-moved (nothing applied), then whole in layout 1
    tombstone = pull(job.shards[0], 0, 0, OLD.fingerprint)
    refused(lambda: job.push(0, base=stops[0], again=(number, grad)), grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 0",
            "moved to layout 1", unchanged=_Shard(job, 0, NEW.fingerprint))
    after = pull(job.shards[0], 0, 0, OLD.fingerprint)
    assert (after[0].version, after[0].layout_epoch) == (stops[0], 1) and torch.equal(after[1], tombstone[1])
    assert job.push(1, base=stops[1] - 1, again=(job.seq[(1, 0)], torch.ones(OLD_RANGES[1][1] - OLD_RANGES[1][0])))[
        0].outcome == pb.DUPLICATE  # an acknowledged push's retry in the old layout: still DUPLICATE from the tombstone
    flat = torch.zeros(P)
    flat[OLD_RANGES[0][0]:OLD_RANGES[0][1]] = grad
    for i, (a, b) in enumerate(NEW_RANGES):  # re-sent with its old base: staleness counted from R
        reply, _, _ = job.push(i, base=stops[0] if a < OLD_RANGES[0][1] else stops[1], layout=1,
                               again=(1, flat[a:b].clone()))
        assert (reply.outcome, reply.version, reply.layout_epoch) == (pb.APPLIED, R + 1, 1)
    job.seq.update({(i, 1): 1 for i in range(3)})
    for i in range(3):
        for _ in range(2):
            assert job.push(i, layout=1)[0].outcome == pb.APPLIED
    pulled = torch.cat([pull(s, 1, R + 3, NEW.fingerprint)[1] for s in job.shards])
    assert torch.equal(pulled, job.want)  # 0 lost, 0 applied twice
    assert all(job.reshard(i, Op.STATUS).followed for i in range(3))
    for i in range(3):
        job.reshard(i, Op.RETIRE)
    assert set(job.phases()) == {"source:retired", "dest:serving"}


def test_on_abort_an_async_jobs_held_push_sent_again_is_applied_in_the_old_layout(shard_server):
    job = AsyncJob(shard_server)
    stops = job.committed()
    held, number, grad = job.push(1, later=True)
    assert held.exception(timeout=10).code() == grpc.StatusCode.UNAVAILABLE
    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=False).layout_epoch == 0
    reply, _, _ = job.push(1, again=(number, grad))
    assert (reply.outcome, reply.version) == (pb.APPLIED, stops[1] + 1)
    job.pushes(0, 1)
    pulled = torch.cat([pull(s, 0, 0, OLD.fingerprint)[1] for s in job.shards[:2]])
    assert torch.equal(pulled, job.want)


def test_decide_switch_naming_a_round_below_an_async_stop_is_failed_precondition_naming_both(shard_server):
    job = AsyncJob(shard_server)
    stops = job.committed()
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every source to vote")
    refused(lambda: job.reshard(1, Op.DECIDE, switch=True, round=stops[0]), grpc.StatusCode.FAILED_PRECONDITION,
            f"round is {stops[0]}", f"reach version {stops[1]}", unchanged=_Shard(job, 1))
    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=True, round=max(stops)).layout_epoch == 1


@pytest.mark.parametrize("job_spec, fragments", [
    (async_spec(optimizer=OptimizerConfig("adam", lr=0.01)), ("optimizer is adam", "optimizer sgd")),
], ids=["async-adam"])
def test_prepare_of_an_async_job_this_stage_cannot_move_is_failed_precondition_naming_the_field(
        shard_server, job_spec, fragments):
    job = AsyncJob(shard_server, job_spec)
    refused(lambda: job.reshard(0, Op.PREPARE), grpc.StatusCode.FAILED_PRECONDITION, *fragments,
            unchanged=_Shard(job, 0))
    assert job.reshard(0, Op.STATUS).handoffs == []
    assert job.push(0)[0].outcome in (pb.APPLIED, pb.ACCEPTED)  # still serves


@pytest.mark.parametrize("policy, counter", [("drop", "stale_dropped"), ("scale", "stale_dropped_handoff")])
def test_a_stale_timeout_job_moves_2_to_3_and_a_stale_push_at_r_is_dropped_never_scaled_into_round_r(
        shard_server, policy, counter):
    from tests.integration.test_handoff_io import Job, blocked_at_r, spec
    from tests.integration.test_handoff_io import _Shard as SyncShard
    job = Job(shard_server, spec(mode="stale-timeout", sync_timeout=60.0, stale_policy=policy))
    job.rounds(2)
    R, held = blocked_at_r(job)
    fp = job.job.fingerprint
    refused(lambda: job.push(0, R - 2), grpc.StatusCode.ABORTED, f"base version {R - 2}",
            f"version {R}", unchanged=SyncShard(job, 0))  # scale: would have opened round R on the old layout
    assert job.shards[0].stats(fingerprint=fp).counters[counter] == 1
    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=True).layout_epoch == 1
    assert [(f.result().version, f.result().layout_epoch) for f in held] == [(R, 1)] * 2
    at_r = torch.cat([pull(s, 0, R, fp)[1] for s in job.shards[:2]])
    new_fp = new_job(job.job, 3).fingerprint
    assert torch.equal(torch.cat([pull(s, 1, R, new_fp)[1] for s in job.shards]), at_r)
    refused(lambda: job.push(1, R - 1), grpc.StatusCode.ABORTED, f"base version {R - 1}")  # the tombstone: stale
    for i in range(3):  # the new layout takes round R
        assert job.push(i, R, layout=1).outcome in (pb.APPLIED, pb.ACCEPTED)
