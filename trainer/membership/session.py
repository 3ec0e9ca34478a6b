"""A trainer's membership of the job: register with every slot, keep the lease, rejoin a restarted shard, leave.

What the shards know of this trainer is decided here and nowhere else: ``registered`` (the slots close() must
leave), the dense slices due to resume after a table call rejoined their shard, and what each Leave was answered.
``Session`` is composed of a room per concern, each owning its part: registering and the join protocol
(``registration``, trainer.membership.registration: the rank, the job, the slots that know this trainer), the
lease (``heartbeats``, trainer.membership.lease), a restarted shard's rejoin and the tables' resync (``rejoins``,
trainer.membership.rejoins), leaving (``leaving``, trainer.membership.leaving).  ``Membership``: the job's
membership epochs as far as this trainer needs them.
"""

from __future__ import annotations

import logging
from typing import Callable

import grpc

from psserver.protocol.epochs import Epoch, epoch_at
from trainer.channels.client import ShardClient, ShardedClient
from trainer.membership.lease import Heartbeats
from trainer.membership.leaving import Leaving
from trainer.membership.registration import (  # noqa: F401 -- re-exported (their old home)
    Registration, StartTimeout, plain_member_from)
from trainer.membership.rejoins import Rejoins, joined_round  # noqa: F401 -- re-exported (its old home)
from trainer.membership.slots import DenseSlots

log = logging.getLogger(__name__)


class Session:
    """Registration, heartbeats, rejoining and leaving for one trainer over ``slots``."""

    def __init__(self, slots: DenseSlots, rank: int, connect_timeout: float, refused_limit: float | None,
                 before_rejoin: Callable[[int], None] = lambda slot: None):
        """``before_rejoin(slot)``: drops what the exchange still expects from a shard that restarted."""
        self.slots, self.client = slots, slots.client
        self.heartbeats = Heartbeats(self.client)
        self.leaving = Leaving(self.client)
        self.registration = Registration(slots, rank, connect_timeout, refused_limit, self.heartbeats, self.leaving)
        self.rejoins = Rejoins(slots, self.registration, before_rejoin)

    # ------------------------------------------------------------------ what the shards know of this trainer
    @property
    def rank(self) -> int:
        """The rank this trainer's calls carry (a join: the one the job handed out)."""
        return self.registration.rank

    @property
    def job(self):
        """The job this trainer registers for (after a layout switch: the new layout's)."""
        return self.registration.job

    @property
    def connect_timeout(self) -> float:
        return self.registration.connect_timeout

    @property
    def registered(self) -> set[int]:
        """The slots that know this trainer: close() leaves exactly these."""
        return self.registration.registered

    @property
    def member_from(self) -> dict[int, int]:
        """shard -> the round a plain Register of this rank (it had left) took."""
        return self.registration.member_from

    @property
    def rows(self):
        """The tables' client, once bound (track_rows): resynced after a restart."""
        return self.rejoins.rows

    @property
    def resume_dense(self) -> dict[int, int]:
        """slot -> dense version before a restart a table call found (its weights are due)."""
        return self.rejoins.resume_dense

    @property
    def left(self) -> bool:
        """Every shard that knew this trainer was told it left."""
        return self.leaving.left

    @property
    def leave_answers(self) -> dict[int, str]:
        """slot -> LEFT, NOT_LISTED or the error its Leave got."""
        return self.leaving.leave_answers

    def track_rows(self, rows, joined_at: int = 0) -> None:
        """Bind the tables' client, its lanes starting at the tables' versions on each shard (Rejoins.track_rows)."""
        self.rejoins.track_rows(rows, joined_at)

    # ------------------------------------------------------------------ joining (trainer.membership.registration)
    def join(self, timeout: float, running: bool = False, follow: Callable | None = None) -> None:
        """Register with every shard, start heartbeats, initialise (rank 0), and take the first weights --
        all within one ``timeout`` (Registration.join; ``running``: the join protocol, ``follow``: a later
        layout a Register's ``layout-moved`` refusal named)."""
        self.registration.join(timeout, running, follow)

    def join_running(self, timeout: float) -> tuple[list, int]:
        """The join protocol, asked again while a commit or confirm is refused (Registration.join_running)."""
        return self.registration.join_running(timeout)

    def set_rank(self, rank: int) -> None:
        """The rank the job gave this trainer (a join): every call from now on carries it."""
        self.registration.set_rank(rank)

    def relaid(self, job) -> None:
        """The slots were switched to a later layout (trainer.membership.relayout): the new job, a rejoin lock per new slot.
        The shards copied the members with the state, so every new slot knows this trainer (a NOT_FOUND there
        registers again in the new layout, as after a restart)."""
        self.registration.relaid(job)
        self.rejoins.relaid()

    # ------------------------------------------------------------------ a shard restarted (trainer.membership.rejoins)
    def step_begins(self) -> None:
        self.rejoins.step_begins()

    def step_ends(self) -> None:
        self.rejoins.step_ends()

    def rejoin(self, s: ShardClient, cause: grpc.RpcError) -> bool:
        """The shard restarted: register again and resume from it; whether this step's gradient is to be pushed to
        it again (Rejoins.rejoin)."""
        return self.rejoins.rejoin(s, cause)

    def rejoin_for_tables(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """A table call found shard ``s`` restarted (ShardedRows.on_restart): register again and resync the
        tables now; the dense slice resumes at this step's dense exchange (Rejoins.rejoin_for_tables)."""
        self.rejoins.rejoin_for_tables(s, cause)

    def resume_dense_slice(self, s: ShardClient, dropped: bool = False) -> None:
        """Pull shard ``s``'s weights after it was rejoined and count what it lost (Rejoins.resume_dense_slice)."""
        self.rejoins.resume_dense_slice(s, dropped)

    def register_again(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """Register with a restarted shard and resync the tables from it (Rejoins.register_again)."""
        self.rejoins.register_again(s, cause)

    # ------------------------------------------------------------------ the lease and leaving
    def stop_heartbeats(self) -> None:
        """Before the channels close under them."""
        self.heartbeats.stop()

    def leave(self, best_effort: bool) -> None:
        """Tell every slot that knows this trainer that it left; best effort: one quick try each, from this
        thread, failures recorded in ``leave_answers`` instead of raised."""
        self.leaving.leave(self.registration.registered, self.registration.rank, best_effort)

    def leave_outcome(self) -> str:
        """What closing told the shards, in words that claim no more than their answers (for ps-trainer's last
        line): left, had registered nowhere, or could not leave which shard and why."""
        return self.leaving.outcome()


class Membership:
    """The job's membership epochs as far as this trainer needs them (docs/elastic.md): who trains which round,
    and the leave announced with the next push."""

    def __init__(self, client: ShardedClient, num_trainers: int, sync: bool = False):
        """``sync``: every shard serves each round with the same membership epoch, so a difference between the
        epochs they name for one round is reported (``check_agreement``)."""
        self.client, self.num_trainers, self.sync = client, num_trainers, sync
        self.timeline: list[Epoch] = []
        self._reported: set = set()  # the disagreements logged (each once)

    def members_at(self, round_: int) -> list[int]:
        """The ranks of the job's membership epoch at ``round_``, sorted.  The timeline is fetched again only
        when the weights received name an epoch this trainer does not know yet, or its list was not sent (a
        reply lists members only from the round asked for, within a byte bound: docs/limits.md)."""
        if self.sync:
            self.check_agreement(round_)
        newest = max(s.calls.epoch_seen for s in self.client.parts)
        if (not self.timeline or newest not in {e.number for e in self.timeline}
                or not epoch_at(self.timeline, round_).listed):
            self.fetch_timeline(max(self.client.parts, key=lambda p: p.calls.epoch_seen), from_round=round_)
        if not self.timeline:  # a shard from before epochs: the job's ranks
            return list(range(self.num_trainers))
        epoch = epoch_at(self.timeline, round_)
        if not epoch.listed:
            raise RuntimeError(f"the shard sent epoch {epoch.number}'s size ({epoch.size}) without its members "
                               f"although round {round_} was asked for")
        return sorted(epoch.members)

    def check_agreement(self, round_: int) -> bool:
        """Whether every shard that sent weights of ``round_`` named the same membership epoch for it.  Sync
        shards change membership at the same rounds (docs/elastic.md), so a difference means their timelines
        split -- a joiner lost between its confirms -- and every round's batch is placed by one shard's members
        while another's rounds wait for others: counted (``membership_mismatches``) and logged as an error, once
        per difference, with both timelines."""
        named = {s.name: s.calls.epoch_seen for s in self.client.parts
                 if s.calls.epoch_round == round_ and s.calls.epoch_seen}
        if len(set(named.values())) < 2:
            return True
        self.client.count("membership_mismatches")
        key = tuple(sorted(named.items()))
        if key not in self._reported and len(self._reported) < 64:
            self._reported.add(key)
            told = {}
            for s in self.client.parts:
                if s.name in named and named[s.name] not in told.values():
                    told[s.name] = named[s.name]
                    try:
                        epochs = [(e.number, e.round, sorted(e.members)[:16]) for e in _timeline_of(s)][-8:]
                    except grpc.RpcError as e:
                        epochs = f"not fetched: {e.code().name}"
                    log.error("the shards disagree on round %d's membership: %s names epoch %d; its timeline: %s",
                              round_, s.name, named[s.name], epochs)
            log.error("membership epochs named for round %d by shard: %s -- the shards' timelines split (a joiner "
                      "lost between its confirms?); batches are placed by %s's (docs/elastic.md)", round_,
                      ", ".join(f"{n} {e}" for n, e in named.items()),
                      max(self.client.parts, key=lambda p: p.calls.epoch_seen).name)
        return False

    def fetch_timeline(self, part=None, from_round: int = 0) -> list[Epoch]:
        """The job's membership timeline as ``part`` (default: partition 0 of shard 0) knows it now: every
        epoch's round and size, the member lists of the epochs from ``from_round`` on (as many as the reply's
        bound holds; docs/limits.md)."""
        self.timeline = _timeline_of(part or self.client.parts[0], from_round)
        self.client.count("timeline_fetches")
        return self.timeline

    def announce_leave(self) -> None:
        """Mark every partition's next push as this trainer's last."""
        for s in self.client.parts:
            s.dense.leaving = True


def _timeline_of(part, from_round: int = 0) -> list[Epoch]:
    """The membership timeline as ``part``'s shard knows it now, members listed from ``from_round`` on."""
    return [Epoch.from_proto(e) for e in part.stats(members_from_round=from_round).epochs]
