"""Membership epochs: the part of elastic jobs both sides must agree on (docs/elastic.md).

A job's trainers are numbered in epochs: epoch ``e`` = (the members, the first round they are expected
in).  Epoch 0 is ranks ``0..num_trainers-1`` from round 0.  A join (``RegisterRequest.join``) or a leave
starts a new epoch at a round every shard agrees on, so no round mixes two epochs; a trainer learns the
epoch of the weights it pulled from ``ChunkHeader.membership_epoch`` and the timeline from
``StatsReply.epochs``, and splits its data by it (trainer.data.DataPlan).

The join window: a shard at version ``v`` proposes round ``v + JOIN_LEAD`` and, until the join is settled,
closes no round past ``v`` (the round open now closes as usual).  The joiner commits at ``E`` = the largest
proposal; a shard takes a commit only while ``version < E <= version + MAX_JOIN_AHEAD`` -- so version ``E``
(the first the new member computes on) is never served before every shard knows the new epoch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from psserver.protocol.proto import ps_pb2 as _pb

JOIN_LEAD = 2  # a shard at version v proposes round v + 2: round v (open now) and v + 1 keep the old epoch
# Shards of a sync job are at most one round apart, so a commit is at most JOIN_LEAD + 1 ahead of any shard.
MAX_JOIN_AHEAD = JOIN_LEAD + 1
MAX_EPOCHS = 4096  # a job's timeline is bounded: a join past it is refused (RESOURCE_EXHAUSTED)
LR_SCALINGS = ("none", "linear")  # --lr-scaling: the trainer's rate for a changing global batch


@dataclass(frozen=True)
class Epoch:
    """Members ``members`` are the ones expected in every round from ``round`` until the next epoch's."""

    number: int
    round: int
    members: frozenset[int]

    def to_proto(self) -> _pb.MembershipEpoch:
        return _pb.MembershipEpoch(number=self.number, round=self.round, members=sorted(self.members))

    @staticmethod
    def from_proto(msg: _pb.MembershipEpoch) -> "Epoch":
        return Epoch(msg.number, msg.round, frozenset(msg.members))


def epoch_at(timeline: list[Epoch], round_: int) -> Epoch:
    """The epoch in effect at ``round_`` (timelines are sorted by round, starting at round 0)."""
    i = bisect.bisect_right([e.round for e in timeline], round_) - 1
    return timeline[max(i, 0)]


def commit_window(version: int, join_round: int) -> str:
    """'' when a shard at ``version`` may admit a joiner at ``join_round``; else why not ("late"/"ahead")."""
    if join_round <= version:
        return "late"
    if join_round > version + MAX_JOIN_AHEAD:
        return "ahead"
    return ""


def lr_factor(scaling: str, members: int, num_trainers: int) -> float:
    """The factor on the job's rate for a round of ``members`` trainers: "linear" scales it with the global
    batch (Goyal et al.'s rule, relative to the job's first epoch); "none" keeps the per-sample rate's mean."""
    if scaling != "linear" or not members or not num_trainers:
        return 1.0
    return members / num_trainers
