"""Draining a shard from a running job live (docs/design/handoff-io.md, issue 24 item 4): real shards over gRPC on
loopback, the test as the coordinator and as a sync trainer of rank 0 whose gradient for round v is a function of
v alone (so a job on other shards, pushed the same, is the reference).  3 -> 2 with pushes during the copy, and
2 -> 3 -> 2 through both hand-offs, bit for bit; RETIRE frees every tombstone; the drain's refusals, each with its
one status, a message naming the field and both values, the state digest unchanged and the shard still serving."""

import dataclasses
from collections import Counter

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.errors import NOT_IN_LAYOUT, REASON_METADATA_KEY
from psserver.protocol.job import OptimizerConfig
from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.layouts import LayoutEpoch, new_job, plan_moves
from psserver.protocol.proto import ps_pb2 as pb
from psserver.resharding.handoff.forward_log import copy_range, range_digest
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until
from tests.integration.test_handoff_io import pull

Op = pb.ReshardRequest
SGD = OptimizerConfig("sgd", lr=0.5, momentum=0.9)


def spec_on(m: int, optimizer=SGD):
    s = make_spec(num_shards=m)
    return dataclasses.replace(s, optimizer=optimizer, fingerprint=Layout.from_shapes(s.tensors, m).fingerprint())


def grad(v: int) -> torch.Tensor:
    """Round ``v``'s whole gradient: every layout pushes its slices of the same one."""
    return torch.randn(P, generator=torch.Generator().manual_seed(1000 + v))


class Run:
    """A sync dense job for rank 0 on ``shards[i] for i in self.on`` (layout ``epoch``), driven by the test."""

    def __init__(self, shards, first: list[int], optimizer=SGD):
        self.shards, self.on, self.epoch, self.job = shards, list(first), 0, spec_on(len(first), optimizer)
        self.seq = Counter()
        self.held = []  # round R-1's pushes, whose replies wait for DECIDE (psserver.serving.reply_holds)
        for s in shards:  # a held reply waits for DECIDE, however slow the machine, not for the timeout
            s.server.handoffs.timeout = 60.0
        init = torch.randn(P, generator=torch.Generator().manual_seed(0))
        for j, (a, b) in enumerate(self.ranges()):
            s = shards[self.on[j]]
            s.register(spec=self.job, expected_shard=j)
            h = s.header(n=b - a, fingerprint=self.job.fingerprint)
            assert s.stub.Init(encode(wire_tensor(init[a:b], pb.FLOAT32), h, 1024), timeout=10).accepted

    def ranges(self, on=None) -> list[tuple[int, int]]:
        m = len(on if on is not None else self.on)
        return [shard_range(P, m, j) for j in range(m)]

    def addresses(self, on) -> list[str]:
        return [self.shards[i].server.address for i in on]

    def version(self, j: int) -> int:
        return self.shards[self.on[j]].stats(fingerprint=self.job.fingerprint).version

    def push(self, j: int, base: int, epoch=None, later=False):
        """``later``: the call's future, not waited for (a reply held until DECIDE)."""
        epoch = self.epoch if epoch is None else epoch
        (a, b), i = self.ranges()[j], self.on[j]
        self.seq[(i, epoch)] += 1
        h = self.shards[i].header(n=b - a, version=base, sequence=self.seq[(i, epoch)], fingerprint=self.job.fingerprint)
        h.layout_epoch = epoch
        call = self.shards[i].stub.Push.future if later else self.shards[i].stub.Push
        return call(encode(wire_tensor(grad(base)[a:b], pb.FLOAT32), h, 1024), timeout=60 if later else 10)

    def rounds(self, upto: int, held=False) -> list:
        """Push until every shard is at ``upto``; ``held``: ``upto`` is R, and round R-1's pushes are futures."""
        if held:
            self.rounds(upto - 1)
            return [self.push(j, upto - 1, later=True) for j in range(len(self.on))]
        for j in range(len(self.on)):
            while (v := self.version(j)) < upto:
                assert self.push(j, v).outcome == pb.APPLIED

    def weights(self, version: int) -> torch.Tensor:
        return torch.cat([pull(self.shards[i], self.epoch, version, self.job.fingerprint)[1] for i in self.on])

    # ------------------------------------------------------------------ the coordinator's calls
    def call(self, i: int, op, plan: str, to: list[int], **kw):
        return self.shards[i].stub.Reshard(pb.ReshardRequest(
            op=op, plan=plan, old_addresses=self.addresses(self.on), new_addresses=self.addresses(to),
            you=self.shards[i].server.address, **kw), timeout=10)

    def phases(self, plan: str, to: list[int]) -> list[str]:
        return [r.phase for i in sorted({*self.on, *to}) for r in self.call(i, Op.STATUS, plan, to).handoffs
                if r.plan == plan]

    def prepare_and_commit(self, plan: str, to: list[int]) -> int:
        """PREPARE (new shards first), three rounds pushed during the copy, PROPOSE, COMMIT, rounds up to R, every
        source blocked and every new piece ready; returns R."""
        for i in [i for i in to if i not in self.on] + self.on:
            self.call(i, Op.PREPARE, plan, to)
        self.rounds(self.version(0) + 3)  # pushes go on during the copy: each closed round is forwarded
        old = LayoutEpoch(0, 0, len(self.on), 1, tuple(self.addresses(self.on)))
        moves = len(plan_moves(P, old, LayoutEpoch(1, 0, len(to), 1, tuple(self.addresses(to)))))
        wait_until(lambda: sorted(Counter(self.phases(plan, to)).items()) == [
            ("dest:replaying", len(to)), ("source:tailing", moves)], "every move to tail, every new piece to replay")
        R = max(self.call(i, Op.PROPOSE, plan, to).proposal for i in self.on)
        for i in sorted({*self.on, *to}):
            self.call(i, Op.COMMIT, plan, to, round=R)
        self.held = self.rounds(R, held=True)
        wait_until(lambda: sorted(set(self.phases(plan, to))) == ["dest:ready", "source:blocked"],
                   "every source blocked at R")
        return R

    def assert_replays_equal_the_old_ranges(self, R: int) -> None:
        """Each new piece's replayed parts equal the old layout's range at R, bit for bit (before DECIDE)."""
        old = [self.shards[i].server.layouts.current.part(0) for i in self.on]
        checked = 0
        for s in self.shards:
            for piece in s.server.handoffs.dests.values():
                for replay in piece.replays.values():
                    src = next(p for p in old if p.start <= replay.a < p.end)
                    assert (src.version, replay.version) == (R, R)
                    want = copy_range(src.slice, src.start, replay.a, replay.b)
                    got = copy_range(replay.dense, replay.a, replay.a, replay.b)
                    assert torch.equal(got.params, want.params)
                    assert range_digest(got.params, got.optimizer) == range_digest(want.params, want.optimizer)
                    checked += replay.b - replay.a
        assert checked == P  # every element of the vector, in exactly one part

    def switch(self, plan: str, to: list[int]) -> None:
        """DECIDE switch everywhere; the test's trainer follows (layout, shards, job)."""
        self.decide(plan, to)
        self.follow(plan, to)

    def decide(self, plan: str, to: list[int]) -> None:
        """DECIDE switch everywhere: round R-1's held replies go out naming the new layout."""
        for i in sorted({*self.on, *to}):
            assert self.call(i, Op.DECIDE, plan, to, switch=True).layout_epoch == self.epoch + 1
        assert [f.result().layout_epoch for f in self.held] == [self.epoch + 1] * len(self.held)

    def follow(self, plan: str, to: list[int]) -> None:
        """The trainer's side of a switch: the next layout's shards, epoch and job."""
        self.gone, self.plan, self.to = [i for i in self.on if i not in to], plan, to
        self.on, self.epoch, self.job = list(to), self.epoch + 1, new_job(self.job, len(to))

    def retire(self) -> dict:
        return {i: self.call(i, Op.RETIRE, self.plan, self.to) for i in sorted({*self.on, *self.gone})}

    def hand_off(self, plan: str, to: list[int]) -> int:
        R = self.prepare_and_commit(plan, to)
        self.assert_replays_equal_the_old_ranges(R)
        self.decide(plan, to)
        at_r = self.weights(R)  # the old layout's tombstones at R (before DECIDE these pulls would wait for it)
        self.follow(plan, to)
        assert torch.equal(self.weights(R), at_r)  # the new layout's pulls concatenate to the old weights at R
        return R


def tombstone_bytes(shard) -> float:
    return shard.stats().counters.get("tombstone_bytes_freed", 0)


@pytest.mark.parametrize("optimizer", [SGD, OptimizerConfig("adam", lr=0.01)], ids=["sgd-momentum", "adam"])
def test_a_job_drains_from_three_shards_to_two_with_pushes_during_the_copy_and_retire_frees_every_tombstone(
        shard_server, optimizer):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]  # no lease runs out mid-test
    run = Run(shards, [0, 1, 2], optimizer)
    run.rounds(2)
    R = run.hand_off("drain", [0, 1])
    drained = shards[2]
    assert [s.stats().drained for s in shards] == ["", "", "tombstone"]
    assert drained.server.layouts.current.part(0).version == R  # the tombstone keeps the old range until RETIRE
    for j in (0, 1):  # the remaining shards serve layout 1 from R
        reply = run.push(j, R)
        assert (reply.outcome, reply.version, reply.layout_epoch) == (pb.APPLIED, R + 1, 1)

    replies = run.retire()
    assert {p for r in replies.values() for p in (h.phase for h in r.handoffs)} <= {"source:retired", "dest:serving"}
    assert [replies[i].drained for i in range(3)] == ["", "", "retired"]
    assert [s.stats().drained for s in shards] == ["", "", "retired"]
    for s in shards:  # every old layout's state is gone, on every shard; the routing record stays
        tomb = s.server.layouts._hosts[0]
        assert all(p.params is None and p.job is None for p in tomb.parts)
        assert [e.number for e in s.server.layouts.timeline()] == [0, 1]
    per_element = 4 * (2 if optimizer.name == "sgd" else 3)  # parameters + momentum, or + Adam's two moments
    for s, (a, b) in zip(shards, run.ranges([0, 1, 2])):  # (+ Adam's step count, a one-element tensor)
        assert (b - a) * per_element <= tombstone_bytes(s) <= (b - a) * per_element + 8
    assert drained.server.handoffs.sources[0].copy is None  # the hand-off's own copy went too
    assert drained.stats().version == 0  # no job state: it may be stopped
    run.rounds(R + 3)  # the job goes on on two shards
    assert [run.version(j) for j in (0, 1)] == [R + 3] * 2


def test_a_job_goes_from_two_shards_to_three_and_back_to_two_and_ends_bit_for_bit_as_one_that_never_resharded(
        shard_server):
    shards = [shard_server(shard=i % 3, lease_timeout=0) for i in range(5)]  # 0-2: the live job; 3-4: the reference
    live, ref = Run(shards, [0, 1]), Run(shards, [3, 4])
    live.rounds(2)
    R1 = live.hand_off("grow", [0, 1, 2])
    live.retire()
    live.rounds(R1 + 2)
    R2 = live.hand_off("shrink", [0, 1])
    assert live.epoch == 2 and live.job.fingerprint == ref.job.fingerprint  # two shards again: the same job's
    replies = live.retire()
    assert replies[2].drained == "retired" and shards[2].stats().drained == "retired"
    end = R2 + 3
    live.rounds(end)
    ref.rounds(end)
    assert torch.equal(live.weights(end), ref.weights(end))  # bit for bit, through both hand-offs
    assert [e.number for e in shards[0].server.layouts.timeline()] == [0, 1, 2]
    held = [p for s in shards[:3] for e, h in s.server.layouts._hosts.items() if e < 2 for p in h.parts
            if p.params is not None]
    assert held == []  # layouts 0 and 1 freed everywhere (shard 2's layout 1 too)


# --------------------------------------------------------------------------------------- refusals
class _Digest:
    """What ``refused(unchanged=...)`` reads: shard ``i``'s state digest, asked as a member of ``job``."""

    def __init__(self, shard, job):
        self.shard, self.job = shard, job

    def digest(self):
        return self.shard.digest(fingerprint=self.job.fingerprint)


@pytest.fixture
def drained(shard_server):
    """A 3 -> 2 drain switched (DECIDE), not retired: shard 2 is the tombstone."""
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1, 2])
    run.rounds(1)
    run.R = run.prepare_and_commit("drain", [0, 1])
    run.old = run.job
    run.switch("drain", [0, 1])
    return run


def test_a_call_in_the_new_layout_to_a_drained_shard_is_failed_precondition_naming_the_layouts_shards(drained):
    run, tomb = drained, drained.shards[2]
    a, b = run.addresses([0, 1])
    h = tomb.header(n=10, version=run.R, sequence=1, fingerprint=run.job.fingerprint)
    h.layout_epoch = 1
    error = refused(lambda: tomb.stub.Push(encode(wire_tensor(torch.zeros(10), pb.FLOAT32), h, 1024), timeout=10),
                    grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 1", tomb.server.address,
                    f"layout 1's shards ['{a}', '{b}']", unchanged=_Digest(tomb, run.old))
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == NOT_IN_LAYOUT
    request = pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=2, job=run.job.to_proto(), layout_epoch=1)
    refused(lambda: tomb.stub.Register(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
            "layout_epoch is 1", f"layout 1's shards ['{a}', '{b}']", unchanged=_Digest(tomb, run.old))
    refused(lambda: pull(tomb, 1, run.R, run.job.fingerprint), grpc.StatusCode.FAILED_PRECONDITION,
            "layout_epoch is 1", f"layout 1's shards ['{a}', '{b}']", unchanged=_Digest(tomb, run.old))
    assert tomb.stats().counters["refused_not_in_layout"] == 2  # the push and the pull (Register: before routing)
    header, _ = pull(tomb, 0, run.R, run.old.fingerprint)  # still serves: the old layout's pulls up to R
    assert (header.version, header.layout_epoch) == (run.R, 1)


def test_a_push_past_r_in_the_old_layout_to_a_drained_shard_is_layout_moved_naming_the_new_layouts_shards(drained):
    run, tomb = drained, drained.shards[2]
    a, b = run.addresses([0, 1])
    lo, hi = shard_range(P, 3, 2)
    h = tomb.header(n=hi - lo, version=run.R, sequence=99, fingerprint=run.old.fingerprint)
    error = refused(lambda: tomb.stub.Push(encode(wire_tensor(grad(run.R)[lo:hi], pb.FLOAT32), h, 1024), timeout=10),
                    grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 0", f"base version {run.R} is at or after round {run.R}",
                    f"layout 1's shards: {a}, {b}", unchanged=_Digest(tomb, run.old))
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "layout-moved"
    assert pull(tomb, 0, run.R, run.old.fingerprint)[0].version == run.R  # still serves


def test_after_retire_every_old_layout_call_is_layout_moved_and_a_member_still_reads_the_timeline(drained):
    run, tomb = drained, drained.shards[2]
    a, b = run.addresses([0, 1])
    run.retire()
    for s in (tomb, run.shards[0]):  # a pull the tombstone answered before RETIRE
        refused(lambda: pull(s, 0, run.R, run.old.fingerprint), grpc.StatusCode.FAILED_PRECONDITION,
                "layout_epoch is 0", "freed (RETIRE)", "send it in layout 1", f"its shards: {a}, {b}")
    h = run.shards[0].header(n=10, version=run.R - 1, sequence=1, fingerprint=run.old.fingerprint)
    refused(lambda: run.shards[0].stub.Push(encode(wire_tensor(torch.zeros(10), pb.FLOAT32), h, 1024), timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 0", "freed (RETIRE)",
            unchanged=_Digest(run.shards[0], run.job))
    # the routing record: a member of the freed layout still reads the timeline (a trainer one layout behind)
    stats = tomb.stats(fingerprint=run.old.fingerprint)
    assert [(e.number, list(e.addresses)) for e in stats.layouts][-1] == (1, [a, b])
    assert (stats.drained, stats.version) == ("retired", 0)
    assert run.push(0, run.R).outcome == pb.APPLIED  # still serves


def test_retire_before_decide_is_failed_precondition_naming_the_state_and_changes_nothing(shard_server):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1, 2])
    run.rounds(1)
    for i in (0, 1, 2):
        run.call(i, Op.PREPARE, "drain", [0, 1])
    refused(lambda: run.call(2, Op.RETIRE, "drain", [0, 1]), grpc.StatusCode.FAILED_PRECONDITION, "retire reached",
            "not handed", unchanged=_Digest(shards[2], run.job))
    assert shards[2].stats().drained == ""
    assert run.push(2, run.version(2)).outcome == pb.APPLIED  # still serves


def test_prepare_on_a_shard_in_neither_list_is_invalid_argument_naming_both_lists(shard_server):
    shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
    run = Run(shards, [0, 1])
    request = pb.ReshardRequest(op=Op.PREPARE, plan="p", old_addresses=run.addresses([0, 1]),
                                new_addresses=run.addresses([0]), you=shards[2].server.address)
    refused(lambda: shards[2].stub.Reshard(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
            f"you is '{shards[2].server.address}'", str(run.addresses([0, 1])))
    assert shards[2].stats().handoffs == []
