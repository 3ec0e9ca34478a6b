"""Membership epochs: the part of elastic jobs both sides must agree on (docs/elastic.md).

A job's trainers are numbered in epochs: epoch ``e`` = (the members, the first round they are expected
in).  Epoch 0 is ranks ``0..num_trainers-1`` from round 0.  A join (``RegisterRequest.join``) or a leave
starts a new epoch at a round every shard agrees on, so no round mixes two epochs; a trainer learns the
epoch of the weights it pulled from ``ChunkHeader.membership_epoch`` and the timeline from
``StatsReply.epochs``, and splits its data by it (trainer.workloads.data.DataPlan).

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
# A job's timeline is bounded: past it, a change that would start an epoch is refused (RESOURCE_EXHAUSTED) --
# a leave is not refused but taken as a lease expiry (psserver.members.epochs).
MAX_EPOCHS = 4096
# A StatsReply's member lists: at most this many bytes of them (each epoch's number, round and size are sent
# besides, at most MAX_EPOCHS x EPOCH_ENTRY_BYTES).  One list of MAX_TRAINERS ranks always fits (< 12 KiB).
MEMBER_LISTS_BYTES = 64 * 1024
EPOCH_ENTRY_BYTES = 24  # an epoch without its members, encoded: tag + length, number, round (uint64), size
LR_SCALINGS = ("none", "linear")  # --lr-scaling: the trainer's rate for a changing global batch


@dataclass(frozen=True)
class Epoch:
    """Members ``members`` are the ones expected in every round from ``round`` until the next epoch's."""

    number: int
    round: int
    members: frozenset[int]
    size: int = -1  # how many members (-1: len(members)); a reply that left the list out sends only this

    def __post_init__(self):
        if self.size < 0:
            object.__setattr__(self, "size", len(self.members))

    @property
    def listed(self) -> bool:
        """Whether ``members`` is the whole list (a StatsReply sends lists only from the round asked for)."""
        return len(self.members) == self.size

    def to_proto(self, with_members: bool = True) -> _pb.MembershipEpoch:
        return _pb.MembershipEpoch(number=self.number, round=self.round, size=self.size,
                                   members=sorted(self.members) if with_members else ())

    @staticmethod
    def from_proto(msg: _pb.MembershipEpoch) -> "Epoch":
        return Epoch(msg.number, msg.round, frozenset(msg.members), max(msg.size, len(msg.members)))


def timeline_to_proto(timeline: list[Epoch], members_from_round: int = 0,
                      budget: int = MEMBER_LISTS_BYTES) -> list[_pb.MembershipEpoch]:
    """A StatsReply's ``epochs``: every epoch's number, round and size; the member lists of the epochs in
    effect at ``members_from_round`` and later, oldest first, while they fit in ``budget`` bytes (the first
    always does: MAX_TRAINERS ranks).  Why bounded: MAX_EPOCHS epochs of MAX_TRAINERS members each would be
    tens of MB -- past gRPC's message limit -- and a trainer needs only the lists of the rounds it computes."""
    first = epoch_index(timeline, members_from_round)
    out, spent = [], 0
    for k, e in enumerate(timeline):
        msg = e.to_proto(with_members=False)
        if k >= first and spent < budget:
            listed = e.to_proto()
            cost = listed.ByteSize() - msg.ByteSize()
            if spent == 0 or spent + cost <= budget:
                msg, spent = listed, spent + cost
            else:
                spent = budget  # the lists stay contiguous: none after the first left out
        out.append(msg)
    return out


def epoch_index(timeline: list[Epoch], round_: int) -> int:
    """The position in ``timeline`` of the epoch in effect at ``round_``."""
    return max(0, bisect.bisect_right([e.round for e in timeline], round_) - 1)


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
