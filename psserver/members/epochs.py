"""A shard's membership epochs as pure decisions: who each round expects, joins and leaves (docs/elastic.md).

No lock, no clock of its own (``now`` is passed in), no network: psserver.partition.shard holds one ``EpochBook`` per
partition, asks it, and carries the answer out; tests drive it with a fake clock.  The rules both sides share
(the join window, the timeline's shape) are psserver.protocol.epochs.

* prepare -- a joiner asks to be admitted; the shard names a rank (the lowest free one below
  ``max_trainers``, or the one partition 0 of shard 0 gave it) and proposes ``version + JOIN_LEAD``.  While
  the join is pending the shard closes no round past ``version`` (``held_from``): the round open now closes
  as usual, later ones wait for the commit (one round trip), so every shard still has version < E when it
  commits.  A pending join the joiner never commits is dropped after ``patience`` seconds (counted).
* commit -- the joiner names the round ``E`` (the largest proposal of every shard): a new epoch from ``E``.
  Taken without a prepare too (a shard that restarted meanwhile) while ``version < E``; a retry of the same
  commit is answered again (idempotent).  The shard then holds round ``E - 1`` until the confirm: another shard
  may refuse the commit (it restarted and served ``E`` meanwhile), and the joiner's Leave must then withdraw
  an epoch no shard has served yet.
* confirm -- every shard took the commit: the hold ends.  A shard that restarted since its commit (and lost
  it) takes the confirm as its commit while ``version < E``.  A committed join never confirmed is withdrawn
  after ``patience`` (counted), as an admission never committed is: the joiner died, or stopped, before it knew
  every shard had committed -- another shard may never have taken the commit, and one that keeps the epoch while
  another drops it splits the shards' timelines for good (the trainers would place every round's batch by a
  member that never trains).  Nothing served round E: it was held.  Withdrawn, the timeline is the one before
  the commit again (the same epoch numbers), so every shard that dropped or withdrew the join agrees.  Only a
  joiner that confirmed on some shards and not others still splits them; the trainers see it (each shard's
  reply names its epoch for the round, trainer.membership.session.Membership compares them) and say so loudly.
* async and stale-timeout (``exact`` False): a shard's versions are its own (a restored shard stays behind its
  peers for good) and no data is split by the round (the job's data cursor places batches), so a commit is
  never refused for its window: each shard takes it at ``E`` clamped into its own window.
* a peer (a host, as gRPC names the caller) whose admissions expire unsettled is refused its next ones for a
  while that doubles with each one in a row (``PeerStrikes``), and one of its joins that settles clears it:
  a stranger who asks and never commits could otherwise hold a sync job's rounds again and again (one hold
  per --join-timeout: a 94x slower job, measured), while a real joiner commits within one round trip.
* leave -- the rank is out of the epoch from round ``at`` on.
* a lease that runs out is not an epoch change: the rank stays a member (it may come back) and rounds stop
  waiting for it through the live set (``expected``).
* the timeline holds at most MAX_EPOCHS epochs: a change that would start one more is refused (``TimelineFull``);
  psserver.members.enrolment takes a leave refused so as a lease expiry (a departing trainer is never kept).
"""

from __future__ import annotations

from dataclasses import dataclass

from psserver.common.logsafe import counted, shorten
from psserver.protocol.epochs import JOIN_LEAD, MAX_EPOCHS, MAX_JOIN_AHEAD, Epoch, commit_window, epoch_at
from psserver.protocol.errors import (
    JOIN_BACKOFF,
    FutureVersion,
    InvalidRequest,
    JobEnded,
    JobFull,
    JobMismatch,
    NoJobToJoin,
    TooBusy,
)


# How long a shard holds a pending join for its commit (--join-timeout 0: this, or the lease if shorter).  The
# commit is one round trip, so seconds are plenty; a stranger who asks and never commits holds a sync job's
# rounds at most this long per request (docs/security.md).  Not the lease: leases may be off (0).
DEFAULT_JOIN_TIMEOUT = 3.0
# Members listed by a job's timeline, summed over its epochs (~50 bytes each held: ~100 MB at most a partition):
# a job of 512 trainers or fewer never reaches it before MAX_EPOCHS; one of 4,096 has 512 epochs (docs/limits.md).
MAX_MEMBER_ENTRIES = 1 << 21
# Joins one job holds pending at once (each shard): a stranger cannot hold every free rank (docs/security.md).
MAX_PENDING_JOINS = 4
# A peer that left joins unsettled waits patience * 2**strikes before its next admission, at most this long.
MAX_JOIN_BACKOFF = 300.0
MAX_PEERS_TRACKED = 1024  # peers with strikes remembered; past it, the ones whose wait ended go first


def join_patience(join_timeout: float, lease_timeout: float) -> float:
    """Seconds a pending join is held for its commit: ``join_timeout`` if set (> 0), else DEFAULT_JOIN_TIMEOUT
    or the lease if that is shorter -- never 0, so leases off (0) do not drop a join at the next tick."""
    if join_timeout > 0:
        return join_timeout
    return min(DEFAULT_JOIN_TIMEOUT, lease_timeout) if lease_timeout > 0 else DEFAULT_JOIN_TIMEOUT


def no_job_to_join(label: str, ended: bool) -> NoJobToJoin:
    """The refusal of a join to a shard without a running job: ``ended`` (its job's trainers all registered and
    left) says the job is over -- the joiner stops -- else none started yet and the joiner waits for rank 0."""
    if ended:
        return JobEnded(f"{label}'s job ended (every trainer left): there is nothing to join until a new job's "
                        "rank 0 registers (ps-trainer without --join)")
    return NoJobToJoin(f"{label} runs no job to join: start the job first (its trainers register without --join)")


class TimelineFull(JobFull):
    """A membership change would start an epoch past MAX_EPOCHS (RESOURCE_EXHAUSTED)."""


class JoinBackoff(TooBusy):
    """A peer's admission refused for a while: its earlier ones expired unsettled (RESOURCE_EXHAUSTED, reason
    ``join-backoff``: a joiner waits it out within its --connect-timeout, trainer.channels.registering)."""

    reason = JOIN_BACKOFF


class PeerStrikes:
    """Per peer: joins left unsettled in a row, and until when its admissions are refused.  Bounded
    (MAX_PEERS_TRACKED); no clock of its own."""

    def __init__(self):
        self._peers: dict[str, tuple[int, float]] = {}  # peer -> (strikes, refused until)

    def check(self, peer: str, now: float) -> None:
        strikes, until = self._peers.get(peer, (0, 0.0))
        if peer and now < until:
            raise JoinBackoff(f"peer {shorten(peer)} left {strikes} join(s) in a row unsettled (asked, never committed "
                              f"and confirmed): its next admission is taken in {until - now:.1f} s; a join of it "
                              "that settles clears this (docs/security.md)")

    def strike(self, peer: str, now: float, patience: float) -> float:
        """One more join of ``peer`` expired unsettled; returns how long its admissions are now refused."""
        if not peer:
            return 0.0
        strikes = self._peers.get(peer, (0, 0.0))[0] + 1
        wait = min(MAX_JOIN_BACKOFF, patience * 2 ** strikes)
        self._peers[peer] = (strikes, now + wait)
        if len(self._peers) > MAX_PEERS_TRACKED:
            ended = [p for p, (_, until) in self._peers.items() if until <= now]
            for p in ended or list(self._peers)[:len(self._peers) - MAX_PEERS_TRACKED]:
                del self._peers[p]
        return wait

    def clear(self, peer: str) -> None:
        self._peers.pop(peer, None)


@dataclass(frozen=True)
class PendingJoin:
    trainer_id: str
    proposal: int  # the round this shard proposed
    held_from: int  # rounds at or past this version do not close until the join is settled
    deadline: float  # clock time after which an unsettled join is dropped (uncommitted) or let go (committed)
    committed: int = 0  # the join round once committed (its epoch is in the timeline): held until the confirm
    peer: str = ""  # who asked (the host gRPC names): its strikes if the join expires unsettled
    patience: float = DEFAULT_JOIN_TIMEOUT  # how long it is held: a strike's wait is a multiple of it
    undo: tuple = ()  # once committed: (the timeline before the commit, the one it made), for a withdrawal


class EpochBook:
    """The timeline of one shard (partition) and its pending joins."""

    def __init__(self, num_trainers: int, max_trainers: int, label: str = "shard"):
        self.num_trainers, self.max_trainers, self.label = num_trainers, max_trainers, label
        self.changes = 0  # timelines swapped in so far (Shard.exposed)
        self.timeline = [Epoch(0, 0, frozenset(range(num_trainers)))]
        self.pending: dict[int, PendingJoin] = {}
        self.strikes = PeerStrikes()

    @property
    def timeline(self) -> list[Epoch]:
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: list[Epoch]) -> None:
        self._timeline = timeline
        self.changes += 1

    # ------------------------------------------------------------------ reads
    @property
    def current(self) -> Epoch:
        return self.timeline[-1]

    def members_at(self, round_: int) -> frozenset[int]:
        return epoch_at(self.timeline, round_).members

    def expected(self, live: frozenset[int], round_: int) -> frozenset[int]:
        """The ranks round ``round_`` waits for: members of its epoch whose lease holds."""
        members = self.members_at(round_)
        return live if live <= members else live & members

    def held_from(self) -> int | None:
        """The first version whose round may not close yet (a join is pending), or None."""
        return min((p.held_from for p in self.pending.values()), default=None)

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self.pending.values()), default=None)

    # ------------------------------------------------------------------ joins
    def free_rank(self) -> int:
        """The lowest rank below max_trainers that is neither a member from now on nor pending."""
        self._check_elastic()
        taken = self.current.members | self.pending.keys()
        for rank in range(self.max_trainers):
            if rank not in taken:
                return rank
        raise JobFull(f"the job is full: {counted(len(taken), 'member')} (pending joins included) of max_trainers "
                      f"{self.max_trainers}; start it with a larger --max-trainers")

    def prepare(self, rank: int | None, trainer_id: str, version: int, now: float, patience: float,
                peer: str = "") -> PendingJoin:
        """Hold a place for ``trainer_id`` (at ``rank``, or a free one); returns what was promised.
        The same joiner asking again gets the same answer (a retry after a lost reply).  ``peer``: who asks;
        refused (JoinBackoff) while its earlier joins' strikes last."""
        self._check_elastic()
        if rank is None:
            rank = next((r for r, p in self.pending.items() if p.trainer_id == trainer_id), None)
            rank = self.free_rank() if rank is None else rank
        previous = self.pending.get(rank)
        if previous is not None and previous.trainer_id == trainer_id:
            return previous
        self._check_rank_free(rank, trainer_id)
        self.strikes.check(peer, now)
        if len(self.pending) >= MAX_PENDING_JOINS:
            raise TooBusy(f"the job has {len(self.pending)} joins pending (not yet committed), its limit "
                          f"{MAX_PENDING_JOINS}: ask again once one is settled (within its --join-timeout)")
        if len(self.timeline) >= MAX_EPOCHS:
            raise TimelineFull(f"join is set but the job's membership timeline holds {len(self.timeline)} epochs, "
                               f"MAX_EPOCHS {MAX_EPOCHS}: no more joins")
        pending = PendingJoin(trainer_id, version + JOIN_LEAD, version + 1, now + patience, peer=peer,
                              patience=patience)
        self.pending[rank] = pending
        return pending

    def rank_of(self, trainer_id: str) -> int | None:
        return next((r for r, p in self.pending.items() if p.trainer_id == trainer_id), None)

    def commit(self, rank: int, trainer_id: str, join_round: int, version: int, now: float = 0.0,
               patience: float = DEFAULT_JOIN_TIMEOUT, exact: bool = True) -> Epoch:
        """Admit ``rank`` from round ``join_round``, holding the round before until the confirm (or
        ``patience``); refused (changing nothing) outside the join window -- ``exact`` False (async,
        stale-timeout): taken at ``join_round`` clamped into it instead.  The same commit again (a retry after a
        lost reply, or after this shard restarted from a checkpoint that has it) is answered the same."""
        self._check_elastic()
        pending = self.pending.get(rank)
        if pending is not None and pending.trainer_id == trainer_id and pending.committed == join_round:
            return epoch_at(self.timeline, pending.held_from + 1)
        joined = self.joined_at(rank) if pending is None and rank in self.current.members else None
        if joined is not None and (joined == join_round or not exact):
            return epoch_at(self.timeline, joined)
        if pending is None or pending.trainer_id != trainer_id:
            self._check_rank_free(rank, trainer_id)
        if pending is not None and pending.committed:
            raise InvalidRequest(f"join_round is {join_round} but {self.label} took this join's commit at round "
                                 f"{pending.committed}: a join commits one round")
        why = commit_window(version, join_round) if exact else ""
        at = join_round if exact else min(max(join_round, version + 1), version + MAX_JOIN_AHEAD)
        if why == "late":
            raise JobMismatch(f"join_round is {join_round} but {self.label} is at version {version}: that round "
                              "was already served without this trainer; join again")
        if why == "ahead":
            raise FutureVersion(f"join_round is {join_round} but {self.label} is at version {version}: at most "
                                f"{version + MAX_JOIN_AHEAD} (an epoch from the future)")
        if pending is not None and join_round < pending.proposal:
            raise InvalidRequest(f"join_round is {join_round} but {self.label} proposed {pending.proposal}: the "
                                 "round must be the largest proposal of every shard")
        before = self.timeline
        epoch = self._change(at, rank, add=True, what=f"join_round {join_round}")  # refused: nothing changed
        proposal = pending.proposal if pending is not None else join_round
        self.pending[rank] = PendingJoin(trainer_id, proposal, at - 1, now + patience, committed=join_round,
                                         undo=(before, self.timeline), peer=pending.peer if pending else "",
                                         patience=patience)
        return epoch

    def confirm(self, rank: int, trainer_id: str, join_round: int, version: int, now: float = 0.0,
                exact: bool = True) -> Epoch:
        """Every shard took the commit: stop holding.  A shard that lost the commit (it restarted since) takes
        this as its commit (``commit``: refused, changing nothing, once it served that round); a confirm again
        is answered the same."""
        pending = self.pending.get(rank)
        if pending is None or pending.trainer_id != trainer_id or pending.committed != join_round:
            epoch = self.commit(rank, trainer_id, join_round, version, now, exact=exact)
        else:
            epoch = epoch_at(self.timeline, pending.held_from + 1)
        settled = self.pending.pop(rank, None)
        if settled is not None:
            self.strikes.clear(settled.peer)  # its peer's joins settle: no more waiting for it
        return epoch

    def joined_at(self, rank: int) -> int | None:
        """The round of the epoch that took ``rank`` in last (it was out of the one before), or None."""
        rounds = [e.round for k, e in enumerate(self.timeline)
                  if k and rank in e.members and rank not in self.timeline[k - 1].members]
        return rounds[-1] if rounds else None

    def abandon(self, rank: int, trainer_id: str) -> bool:
        """Drop ``trainer_id``'s pending join (it gave up); True if there was one."""
        pending = self.pending.get(rank)
        if pending is None or pending.trainer_id != trainer_id:
            return False
        del self.pending[rank]
        return True

    def expire(self, now: float, version: int | None = None) -> list[tuple[int, PendingJoin]]:
        """Drop pending joins past their deadline: an uncommitted one is gone (the joiner died between prepare
        and commit); a committed one is withdrawn (``withdraw``) and stops holding.  ``version``: the shard's
        now (None: before any round closed past the hold)."""
        gone = [(r, p) for r, p in self.pending.items() if now >= p.deadline]
        for rank, pending in gone:
            del self.pending[rank]
            if pending.committed:
                self.withdraw(rank, pending, version)
            self.strikes.strike(pending.peer, now, pending.patience)
        return sorted(gone)

    def withdraw(self, rank: int, pending: PendingJoin, version: int | None) -> None:
        """Take back a committed join never confirmed: the timeline before its commit again if nothing changed it
        since and its round was not served (the usual case: a sync shard held the round before it); else
        ``rank`` leaves from the next round it may (an async shard's versions do not wait for a join)."""
        at = pending.held_from + 1
        before, made = pending.undo or ((), None)
        if self.timeline is made and (version is None or version < at):
            self.timeline = before
            return
        try:
            self._change(max(at, 0 if version is None else version + 1), rank, add=False,
                         what=f"rank {rank}'s unconfirmed join withdrawn")
        except TimelineFull:  # (no room for one more epoch: it stays, as a member that went silent would)
            pass

    # ------------------------------------------------------------------ leaves and plain registrations
    def leave(self, rank: int, at: int) -> Epoch | None:
        """``rank`` is out from round ``at`` on (a pending or future admission is withdrawn); None if it was
        not a member then or later.  Refused (``TimelineFull``, the pending join withdrawn all the same) if it
        would start an epoch past MAX_EPOCHS."""
        self.pending.pop(rank, None)
        if not any(rank in e.members for e in self.timeline if e.round >= at) and rank not in self.members_at(at):
            return None
        return self._change(at, rank, add=False, what=f"rank {rank}'s leave from round {at}")

    def registered(self, rank: int, at: int) -> Epoch | None:
        """A plain (non-join) registration of a rank outside the epoch: a member from round ``at`` (the
        round open now -- what a re-registration always meant); None if it is a member already.  Refused
        (``TimelineFull``, nothing changed) if it would start an epoch past MAX_EPOCHS."""
        if rank in self.members_at(at) or rank in self.current.members:
            return None
        return self._change(at, rank, add=True, what=f"rank {rank} registering (not a member since it left) from "
                                                     f"round {at}")

    def _change(self, at: int, rank: int, add: bool, what: str) -> Epoch:
        """Add ``rank`` to (or take it from) the epoch at round ``at`` and every later one; an epoch starts at
        ``at`` if none did.  Each epoch changed gets a new number, so a trainer that knows the old one sees the
        change (two joins in one round make one epoch with both).  Returns the epoch at ``at``.  Refused
        (``TimelineFull``, nothing changed) past the timeline's bounds (``_check_room``)."""
        timeline = list(self.timeline)  # built aside, then swapped in: readers without the lock never see half
        i = next((k for k, e in enumerate(timeline) if e.round >= at), len(timeline))
        if i == len(timeline) or timeline[i].round != at:
            timeline.insert(i, Epoch(-1, at, epoch_at(timeline, at).members))
        number = max(e.number for e in timeline)
        for k in range(i, len(timeline)):
            e = timeline[k]
            number += 1
            timeline[k] = Epoch(number, e.round, e.members | {rank} if add else e.members - {rank})
        self._check_room(timeline, what)
        self.timeline = timeline
        return timeline[i]

    # ------------------------------------------------------------------ checks
    def _check_room(self, timeline: list[Epoch], what: str) -> None:
        """Every change that starts an epoch counts against MAX_EPOCHS (joins, plain re-registrations, leaves):
        otherwise leave-and-register loops would grow the timeline -- and GetStats, checkpoints, digests -- for
        ever.  A change at a round where an epoch starts already adds none.  The member lists of every epoch
        together count against MAX_MEMBER_ENTRIES: MAX_EPOCHS epochs of MAX_TRAINERS members each held ~770 MB
        a partition (measured, docs/security.md)."""
        if len(timeline) > MAX_EPOCHS:
            raise TimelineFull(f"{what} would start membership epoch {len(timeline)} but the job's "
                               f"timeline holds at most MAX_EPOCHS {MAX_EPOCHS} (docs/limits.md)")
        entries = sum(len(e.members) for e in timeline)
        if entries > MAX_MEMBER_ENTRIES:
            raise TimelineFull(f"{what} would make the job's membership timeline list {entries} members over its "
                               f"{len(timeline)} epochs but it holds at most MAX_MEMBER_ENTRIES {MAX_MEMBER_ENTRIES} "
                               "(docs/limits.md)")

    def _check_elastic(self) -> None:
        if not self.max_trainers:
            raise JobMismatch(f"join is set but the job's max_trainers is 0 (num_trainers {self.num_trainers}): it "
                              f"admits no joiners (start it with --max-trainers K >= {self.num_trainers})")

    def _check_rank_free(self, rank: int, trainer_id: str) -> None:
        if not 0 <= rank < self.max_trainers:
            raise InvalidRequest(f"rank is {rank} but the job admits ranks 0..{self.max_trainers - 1} "
                                 f"(max_trainers {self.max_trainers})")
        if rank in self.current.members:
            raise JobFull(f"rank {rank} is already a member of the job (epoch {self.current.number}): "
                          f"{shorten(trainer_id)} cannot join as it")
        other = self.pending.get(rank)
        if other is not None and other.trainer_id != trainer_id:
            raise JobFull(f"rank {rank} is being joined by {shorten(other.trainer_id)}, not {shorten(trainer_id)}")

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> list[tuple[int, int, list[int]]]:
        return [(e.number, e.round, sorted(e.members)) for e in self.timeline]

    def digest_text(self) -> str:
        """The timeline and the pending joins (not their clock deadlines), for the shard's state digest."""
        pending = sorted((r, p.trainer_id, p.proposal, p.held_from, p.committed) for r, p in self.pending.items())
        return f"epochs={self.state()};pending={pending}"

    def restore_timeline(self, timeline: list[Epoch]) -> None:
        """Put back the timeline a refused push changed (pending joins are left as they are)."""
        self.timeline = list(timeline)

    def restore(self, saved: list | None) -> None:
        """The checkpoint's timeline; pending joins are not kept (their joiner commits without, or again)."""
        if saved:
            self.timeline = [Epoch(n, r, frozenset(m)) for n, r, m in saved]
        self.pending.clear()


