"""A live re-shard carried out by the shards (stage 5 of docs/design/live-reshard.md, docs/design/handoff-io.md): three real
shards over gRPC on loopback, the test as the coordinator, a sync dense job moved from two shards to three
while pushes go on during the copy; and PREPARE's and Handoff's refusals, each with its one status, a message
naming the field and both values, the state digest unchanged and the shard still serving."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.errors import REASON_METADATA_KEY
from psserver.protocol.job import OptimizerConfig
from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.layouts import new_job
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.table import TableSpec
from psserver.resharding.handoff.forward_log import copy_range, range_digest
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until

Op = pb.ReshardRequest


def spec(mode="sync", **kw):
    s = make_spec(num_shards=2, mode=mode, **kw)
    return dataclasses.replace(s, fingerprint=Layout.from_shapes(s.tensors, 2).fingerprint())


OLD = spec()
NEW = new_job(OLD, 3)
OLD_RANGES = [shard_range(P, 2, i) for i in range(2)]
NEW_RANGES = [shard_range(P, 3, i) for i in range(3)]


class Job:
    """Two shards running ``job`` for rank 0, plus an empty third; pushes numbered per shard and layout."""

    def __init__(self, shard_server, job=OLD):
        self.job = job
        self.shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]  # no lease runs out mid-test
        for s in self.shards:  # a held reply waits for DECIDE, however slow the machine, not for the timeout
            s.server.handoffs.timeout = 60.0
        self.old = [s.server.address for s in self.shards[:2]]
        self.new = [s.server.address for s in self.shards]
        self.seq = {}
        gen = torch.Generator().manual_seed(0)
        self.gen = gen
        for i, (a, b) in enumerate(OLD_RANGES):
            self.shards[i].register(spec=job, expected_shard=i)
            h = self.shards[i].header(n=b - a, fingerprint=job.fingerprint)
            values = torch.randn(b - a, generator=gen)
            assert self.shards[i].stub.Init(encode(wire_tensor(values, pb.FLOAT32), h, 1024), timeout=10).accepted

    def push(self, i, base, layout=0, later=False):
        """Push a gradient of base ``base``; ``later``: the call's future, not waited for (a held reply)."""
        a, b = (NEW_RANGES if layout else OLD_RANGES)[i]
        key = (i, layout)
        self.seq[key] = self.seq.get(key, 0) + 1
        h = self.shards[i].header(n=b - a, version=base, sequence=self.seq[key],
                                  fingerprint=NEW.fingerprint if layout else self.job.fingerprint)
        h.layout_epoch = layout
        grad = torch.randn(b - a, generator=self.gen)
        call = self.shards[i].stub.Push.future if later else self.shards[i].stub.Push
        return call(encode(wire_tensor(grad, pb.FLOAT32), h, 1024), timeout=10 if not later else 60)

    def rounds(self, upto, held=False):
        """Push on both old shards until each is at version ``upto``.  ``held``: ``upto`` is R and the replies
        of round R-1 wait for DECIDE: its pushes' futures."""
        if held:
            self.rounds(upto - 1)
            return [self.push(i, upto - 1, later=True) for i in (0, 1)]
        for i in (0, 1):
            while self.shards[i].stats(fingerprint=self.job.fingerprint).version < upto:
                base = self.shards[i].stats(fingerprint=self.job.fingerprint).version
                assert self.push(i, base).outcome == pb.APPLIED

    def reshard(self, i, op, plan="p1", **kw):
        return self.shards[i].stub.Reshard(pb.ReshardRequest(op=op, plan=plan, old_addresses=self.old,
                                                             new_addresses=self.new, you=self.new[i], **kw),
                                           timeout=10)

    def phases(self):
        return [r.phase for i in range(3) for r in self.reshard(i, Op.STATUS).handoffs]

    def digest(self, i):
        return self.shards[i].digest(fingerprint=self.job.fingerprint)


def pull(shard, layout, version, fingerprint):
    chunks = list(shard.stub.Pull(pb.PullRequest(rank=0, trainer_id="t0", fingerprint=fingerprint, min_version=version,
                                                 dtype=pb.FLOAT32, layout_epoch=layout), timeout=10))
    data = b"".join(c.data for c in chunks)
    return chunks[0].header, torch.frombuffer(bytearray(data), dtype=torch.float32)


@pytest.mark.parametrize("optimizer", [OptimizerConfig("sgd", lr=0.5, momentum=0.9),
                                       OptimizerConfig("adam", lr=0.01)], ids=["sgd-momentum", "adam"])
def test_a_sync_dense_job_moves_from_two_shards_to_three_with_pushes_during_the_copy_and_serves_layout_1(
        shard_server, optimizer):
    job = Job(shard_server, dataclasses.replace(OLD, optimizer=optimizer))
    job.rounds(2)
    for i in (2, 0, 1):  # the destinations first: a source's stream to an unprepared shard is only retried
        job.reshard(i, Op.PREPARE)
    job.rounds(5)  # pushes go on during the copy: each closed round is forwarded
    wait_until(lambda: all(p in ("source:tailing", "dest:replaying") for p in job.phases())
               and len(job.phases()) == 4 + 3, "every move to tail and every new piece to replay")
    proposals = [job.reshard(i, Op.PROPOSE).proposal for i in (0, 1)]
    R = max(proposals)
    for i in range(3):
        job.reshard(i, Op.COMMIT, round=R)
    held = job.rounds(R, held=True)  # round R-1's pushes: taken, their replies (version R) wait for DECIDE
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every source blocked")
    counters = [s.stats(fingerprint=OLD.fingerprint).counters for s in job.shards[:2]]
    assert [c["handoff_replies_held"] for c in counters] == [1, 1] and not any(f.done() for f in held)
    assert [c["handoff_copies_sent"] for c in counters] == [2, 2]  # each old shard: two moves, copied once
    # every round closed after the copy (at version 2) was forwarded on each move and replayed
    assert [c["handoff_forwards_sent"] for c in counters] == [2 * (R - 2)] * 2
    replayed = job.shards[2].stats().counters["handoff_forwards_replayed"]
    assert replayed == R - 2 and R - 2 >= 3

    # the destinations' replayed parts equal the sources' ranges at R, bit for bit
    old_parts = [s.server.layouts.current.part(0) for s in job.shards[:2]]
    for dest in job.shards:
        for piece in dest.server.handoffs.dests.values():
            for replay in piece.replays.values():
                src = old_parts[0] if replay.a < P // 2 else old_parts[1]
                assert (src.version, replay.version) == (R, R)
                want = copy_range(src.slice, src.start, replay.a, replay.b)
                got = copy_range(replay.dense, replay.a, replay.a, replay.b)
                assert torch.equal(got.params, want.params)
                assert range_digest(got.params, got.optimizer) == range_digest(want.params, want.optimizer)

    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=True).layout_epoch == 1
    # the held replies went out after the switch, naming the new layout: the trainer sends base R there
    assert [(f.result().outcome, f.result().version, f.result().layout_epoch) for f in held] == [
        (pb.APPLIED, R, 1)] * 2
    at_r = torch.cat([pull(s, 0, R, OLD.fingerprint)[1] for s in job.shards[:2]])  # the tombstones at R
    pulled = [pull(s, 1, R, NEW.fingerprint) for s in job.shards]
    assert [(h.version, h.layout_epoch, len(w)) for h, w in pulled] == [
        (R, 1, b - a) for a, b in NEW_RANGES]
    assert torch.equal(torch.cat([w for _, w in pulled]), at_r)  # layout 1 serves the right ranges at R
    for i in range(3):
        reply = job.push(i, R, layout=1)
        assert (reply.outcome, reply.version, reply.layout_epoch) == (pb.APPLIED, R + 1, 1)
    for i in range(3):
        job.reshard(i, Op.RETIRE)
    assert set(job.phases()) == {"source:retired", "dest:serving"}


def test_a_move_whose_destination_falls_behind_throttles_the_rounds_then_is_copied_again_and_equals_its_source(
        shard_server):
    job = Job(shard_server)
    for s in job.shards:
        s.server.handoffs.max_lag = 3
        s.server.handoffs.timeout = 0.5  # the throttle's bound: past it the move is copied again
    for i in (0, 1):  # the new shard has no plan yet: the moves to it cannot be acknowledged
        job.reshard(i, Op.PREPARE)
    job.rounds(3)  # shard 1's move to shard 2: three rounds past the copy at version 0, so round 3 waits
    for i in (0, 1):  # taken into round 3 (on shard 1 it waits for the forwards until the throttle gives up)
        assert job.push(i, 3).outcome in (pb.ACCEPTED, pb.APPLIED)
    wait_until(lambda: all(s.stats(fingerprint=OLD.fingerprint).version == 4 for s in job.shards[:2]),
               "the throttle to give up after the hand-off timeout and round 3 to close")
    c = job.shards[1].stats(fingerprint=OLD.fingerprint).counters  # its move to shard 2 was never acknowledged
    assert (c["handoff_rounds_throttled"] >= 1, c["handoff_recopies"] >= 1) == (True, True), dict(c)
    for s in job.shards:
        s.server.handoffs.timeout = 60.0
    job.reshard(2, Op.PREPARE)
    sources = [s for shard in job.shards[:2] for s in shard.server.handoffs.sources]
    wait_until(lambda: all(s.machine.state.value == "tailing" and s.machine.forwarded_to == s.machine.version
                           for s in sources), "every move to catch up")
    R = max(job.reshard(i, Op.PROPOSE).proposal for i in (0, 1))
    for i in range(3):
        job.reshard(i, Op.COMMIT, round=R)
    held = job.rounds(R, held=True)
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every source blocked")
    for i in range(3):
        job.reshard(i, Op.DECIDE, switch=True)
    assert [f.result().layout_epoch for f in held] == [1, 1]
    at_r = torch.cat([pull(s, 0, R, OLD.fingerprint)[1] for s in job.shards[:2]])
    assert torch.equal(torch.cat([pull(s, 1, R, NEW.fingerprint)[1] for s in job.shards]), at_r)


def blocked_at_r(job) -> tuple[int, list]:
    """PREPARE (the destination first), every move tailing, COMMIT R, round R-1 pushed: (R, round R-1's held
    replies) once every source is blocked and every new piece ready, before DECIDE."""
    for i in (2, 0, 1):
        job.reshard(i, Op.PREPARE)
    wait_until(lambda: all(p in ("source:tailing", "dest:replaying") for p in job.phases())
               and len(job.phases()) == 7, "every move to tail")
    R = max(job.reshard(i, Op.PROPOSE).proposal for i in (0, 1))
    for i in range(3):
        job.reshard(i, Op.COMMIT, round=R)
    held = job.rounds(R, held=True)
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every source blocked")
    return R, held


def test_a_push_at_or_past_r_in_the_old_layout_before_decide_is_unavailable_handoff_then_layout_moved(
        shard_server):
    """What can still reach the refusal: a trainer that has version R though its reply was held (a reply whose
    hold expired, or a replayed step).  The held reply itself goes out after DECIDE."""
    job = Job(shard_server)
    R, held = blocked_at_r(job)
    error = refused(lambda: job.push(0, R), grpc.StatusCode.UNAVAILABLE, f"base version is {R}",
                    f"hands over at round {R}", unchanged=_Shard(job, 0))
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "handoff"
    assert job.shards[0].stats(fingerprint=OLD.fingerprint).counters["refused_handoff_pending"] == 1
    for i in range(3):
        job.reshard(i, Op.DECIDE, switch=True)
    assert [f.result().version for f in held] == [R, R]  # still serves: the held replies went out
    refused(lambda: job.push(0, R), grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 0")
    assert job.push(0, R, layout=1).outcome == pb.APPLIED  # sent again in the new layout


def test_on_abort_round_r_minus_1s_held_replies_go_out_in_the_old_layout_and_base_r_is_taken_there(shard_server):
    job = Job(shard_server)
    R, held = blocked_at_r(job)
    assert not any(f.done() for f in held)
    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=False).layout_epoch == 0
    assert [(f.result().version, f.result().layout_epoch) for f in held] == [(R, 0), (R, 0)]
    for i in (0, 1):  # the old layout goes on: the step of base R is taken there, not refused
        assert job.push(i, R).outcome == pb.APPLIED
        assert job.shards[i].stats(fingerprint=OLD.fingerprint).counters["refused_handoff_pending"] == 0


@pytest.fixture
def two(shard_server):
    return Job(shard_server)


def still_serves(job, i=0):
    base = job.shards[i].stats(fingerprint=job.job.fingerprint).version
    assert job.push(i, base).outcome == pb.APPLIED


@pytest.mark.parametrize("job_spec, fragments", [  # async and stale-timeout jobs move since stage 8
    (spec(tables=(TableSpec("emb", 4, seed=7, mode="async"),)), ("table 'emb' mode is async", "table mode sync")),
    (spec(mode="async", tables=(TableSpec("emb", 4, seed=7),)), ("table 'emb' mode is async", "table mode sync")),
], ids=["async-table", "async-job-with-a-table"])
def test_prepare_on_a_job_with_an_async_table_is_failed_precondition_naming_the_table(shard_server, job_spec,
                                                                                      fragments):
    job = Job(shard_server, job_spec)
    refused(lambda: job.reshard(0, Op.PREPARE), grpc.StatusCode.FAILED_PRECONDITION, *fragments,
            unchanged=_Shard(job, 0))
    assert job.reshard(0, Op.STATUS).handoffs == []
    still_serves(job)


def test_commit_past_the_commit_window_is_out_of_range_and_decide_before_the_votes_is_failed_precondition(two):
    for i in (2, 0, 1):
        two.reshard(i, Op.PREPARE)
    wait_until(lambda: all(p in ("source:tailing", "dest:replaying") for p in two.phases())
               and len(two.phases()) == 7, "every move to tail")
    version = two.shards[0].stats(fingerprint=OLD.fingerprint).version
    refused(lambda: two.reshard(0, Op.COMMIT, round=version + 9), grpc.StatusCode.OUT_OF_RANGE,
            f"commit round is {version + 9}", f"at version {version}", unchanged=_Shard(two, 0))
    refused(lambda: two.reshard(0, Op.DECIDE, switch=True), grpc.StatusCode.FAILED_PRECONDITION,
            "decide is switch", "not blocked", unchanged=_Shard(two, 0))
    for i in range(3):  # an abort: the old layout goes on
        assert two.reshard(i, Op.DECIDE, switch=False).layout_epoch == 0
    assert set(two.phases()) == {"source:owner", "dest:dropped"}
    assert two.reshard(0, Op.PREPARE, plan="p2").plan == "p2"  # an aborted plan leaves room for the next
    still_serves(two)


def test_prepare_under_another_plan_is_failed_precondition_naming_both_plans(two):
    two.reshard(0, Op.PREPARE, plan="p1")
    refused(lambda: two.reshard(0, Op.PREPARE, plan="p2"), grpc.StatusCode.FAILED_PRECONDITION,
            "plan is 'p2'", "plan 'p1'", unchanged=_Shard(two, 0))
    assert {r.plan for r in two.reshard(0, Op.STATUS, plan="p1").handoffs} == {"p1"}
    still_serves(two)


def test_prepare_while_a_join_is_pending_is_failed_precondition_naming_the_rank(shard_server):
    job = Job(shard_server, spec(max_trainers=2))
    job.shards[0].stub.Register(pb.RegisterRequest(rank=1, trainer_id="t1", expected_shard=0, join=True,
                                                   job=job.job.to_proto()), timeout=10)
    refused(lambda: job.reshard(0, Op.PREPARE), grpc.StatusCode.FAILED_PRECONDITION, "rank 1 has a pending join",
            "rank None pending", unchanged=_Shard(job, 0))


def test_a_handoff_from_a_caller_not_in_the_plan_is_permission_denied_naming_plan_and_caller(two):
    two.reshard(1, Op.PREPARE)
    stranger = pb.HandoffChunk(kind=pb.HandoffChunk.FORWARD, plan="p1", source="10.9.9.9:1", move=0, version=0)
    refused(lambda: two.shards[1].stub.Handoff(iter([stranger]), timeout=10), grpc.StatusCode.PERMISSION_DENIED,
            "source is '10.9.9.9:1'", "plan 'p1'", two.old[0], unchanged=_Shard(two, 1))
    other = pb.HandoffChunk(kind=pb.HandoffChunk.FORWARD, plan="p9", source=two.old[0], move=0, version=0)
    refused(lambda: two.shards[2].stub.Handoff(iter([other]), timeout=10), grpc.StatusCode.PERMISSION_DENIED,
            "plan is 'p9'", "holds plan None")
    still_serves(two, 1)


class _Shard:
    """What ``refused(unchanged=...)`` reads: shard ``i``'s state digest, asked as a member."""

    def __init__(self, job, i):
        self.job, self.i = job, i

    def digest(self):
        return self.job.digest(self.i)


def test_a_move_that_aborts_on_its_own_ends_the_plan_on_its_shard_and_lifts_the_handoff_refusals(shard_server):
    """A machine-initiated abort (here the termination: the peers agreed to abort; a throttle timed out once
    committed takes the same path) ends the plan on the shard: the held reply goes out in the old layout, a push
    of base R is taken there and a join is admitted -- before, both stayed refused ``handoff`` after the plan was
    gone, until a DECIDE that may never come."""
    from psserver.resharding.handoff import machine as h

    job = Job(shard_server, spec(max_trainers=2))
    R, held = blocked_at_r(job)
    io = job.shards[0].server.handoffs
    side = io.sources[0]  # one move of shard 0 gives up: the whole plan is over on shard 0
    io.on_state(io.event, side, h.PeerAnswers((("peer", "abort"),)))
    assert {s.machine.state.value for s in io.sources} == {"owner"} and io.decision.settled()
    assert held[0].result().version == R and held[0].result().layout_epoch == 0
    counters = job.shards[0].stats(fingerprint=OLD.fingerprint).counters
    # its two moves and its new piece, each counted once
    assert (counters["handoff_plans_aborted_here"], counters["handoff_aborts"]) == (1, 3)
    assert job.push(0, R).outcome == pb.APPLIED  # no 'handoff' refusal: the old layout goes on
    reply = job.shards[0].stub.Register(pb.RegisterRequest(rank=1, trainer_id="t1", expected_shard=0, join=True,
                                                           job=job.job.to_proto()), timeout=10)
    assert reply.join_round > 0  # admitted, not UNAVAILABLE 'handoff'
    refused(lambda: job.reshard(0, Op.DECIDE, switch=True), grpc.StatusCode.FAILED_PRECONDITION, "decide is switch",
            "aborted: a late switch is refused", unchanged=_Shard(job, 0))


def test_ps_server_handoff_timeout_reaches_the_shards_hand_off_which_gives_it_to_its_moves_and_held_replies(
        shard_server):
    assert shard_server(shard=0).server.handoffs.timeout == 3.0
    assert shard_server(shard=1, handoff_timeout=7.5).server.handoffs.timeout == 7.5
