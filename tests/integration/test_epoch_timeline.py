"""The membership timeline over real gRPC stays bounded (docs/limits.md): GetStats sends every epoch's round and
size but member lists only from ``members_from_round`` on; every change that would start an epoch past
MAX_EPOCHS is refused (a plain re-registration, a join's commit) -- RESOURCE_EXHAUSTED, the state digest
unchanged, the shard still serving -- except a leave, which is taken as a lease expiry and counted.

MAX_EPOCHS is lowered for these tests (the shard runs in this process): 4,096 leave-and-register loops over the
wire would prove nothing more."""

import grpc
import pytest
import torch

from psserver.members import epochs as shard_epochs
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused

FP = "f" * 16


def leave(shard, rank: int, trainer_id: str | None = None):
    return shard.stub.Leave(pb.LeaveRequest(rank=rank, trainer_id=trainer_id or f"t{rank}", fingerprint=FP), timeout=10)


def round_of(shard, ranks, version: int):
    """Each rank in ``ranks`` pushes round ``version``; returns the last push's outcome."""
    return [shard.push(torch.ones(P), rank=r, trainer_id=t, version=version).outcome for r, t in ranks][-1]


def timeline(shard, members_from_round=0):
    reply = shard.stub.GetStats(pb.StatsRequest(members_from_round=members_from_round), timeout=10)
    return [(e.round, e.size, list(e.members)) for e in reply.epochs]


@pytest.fixture
def two(shard_server):
    """A sync job of two trainers (no --max-trainers: plain registrations only) after round 0."""
    shard = shard_server(lease_timeout=0)
    spec = make_spec(num_trainers=2)
    for r in range(2):
        shard.register(rank=r, spec=spec)
    shard.init(torch.zeros(P))
    assert round_of(shard, [(0, "t0"), (1, "t1")], 0) == pb.APPLIED
    return shard, spec


def test_get_stats_sends_every_epochs_size_but_member_lists_only_from_the_round_asked(two):
    shard, spec = two
    leave(shard, 1)  # out from round 1
    assert round_of(shard, [(0, "t0")], 1) == pb.APPLIED
    shard.register(rank=1, spec=spec, trainer_id="t1-again")  # a plain re-registration: in again from round 2
    assert timeline(shard) == [(0, 2, [0, 1]), (1, 1, [0]), (2, 2, [0, 1])]
    assert timeline(shard, members_from_round=1) == [(0, 2, []), (1, 1, [0]), (2, 2, [0, 1])]
    assert timeline(shard, members_from_round=5) == [(0, 2, []), (1, 1, []), (2, 2, [0, 1])]


def test_leave_and_register_loops_are_refused_past_max_epochs_resource_exhausted_and_the_shard_still_serves(
        two, monkeypatch):
    shard, spec = two
    monkeypatch.setattr(shard_epochs, "MAX_EPOCHS", 2)
    leave(shard, 1)  # epoch 2 of 2, from round 1
    assert round_of(shard, [(0, "t0")], 1) == pb.APPLIED
    refused(lambda: shard.register(rank=1, spec=spec, trainer_id="t1-again"), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rank 1 registering", "from round 2", "would start membership epoch 3", "MAX_EPOCHS 2", unchanged=shard)
    assert [r for r, _, _ in timeline(shard)] == [0, 1] and list(shard.stats().live_ranks) == [0]
    assert round_of(shard, [(0, "t0")], 2) == pb.APPLIED  # still serving, the round not waiting for rank 1


def test_a_leave_past_max_epochs_is_not_refused_but_taken_as_a_lease_expiry_and_counted(two, monkeypatch):
    shard, _ = two
    monkeypatch.setattr(shard_epochs, "MAX_EPOCHS", 1)
    leave(shard, 1)
    assert timeline(shard) == [(0, 2, [0, 1])]  # no epoch started: rank 1 stays a member, out of the live set
    assert shard.stats().counters["leaves_past_max_epochs"] == 1
    assert round_of(shard, [(0, "t0")], 1) == pb.APPLIED  # the round does not wait for the leaver


def test_a_joins_commit_past_max_epochs_is_refused_and_leaves_the_join_pending(shard_server, monkeypatch):
    shard = shard_server(lease_timeout=0)
    spec = make_spec(num_trainers=2, max_trainers=3)
    for r in range(2):
        shard.register(rank=r, spec=spec)
    shard.init(torch.zeros(P))
    round_of(shard, [(0, "t0"), (1, "t1")], 0)
    monkeypatch.setattr(shard_epochs, "MAX_EPOCHS", 2)
    ask = pb.RegisterRequest(trainer_id="joiner", job=spec.to_proto(), join=True)
    proposal = shard.stub.Register(ask, timeout=10).join_round
    leave(shard, 1)  # epoch 2 of 2, from round 1
    ask.rank, ask.join_round = 2, proposal
    refused(lambda: shard.stub.Register(ask, timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"join_round {proposal} would start membership epoch 3", "MAX_EPOCHS 2", unchanged=shard)
    assert round_of(shard, [(0, "t0")], 1) == pb.APPLIED  # the open round closes as usual
