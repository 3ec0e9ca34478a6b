"""Who is in a shard's job: registrations, elastic joins, leaves, leases and the membership epochs.

The room of ``Shard`` (psserver.partition.shard) that decides membership: it owns the leases (psserver.members.membership), the
epoch timeline with its pending joins (psserver.members.epochs) and whether every trainer has registered, and logs
and counts each change; its ``checks`` refuse strangers and pushes from outside an epoch
(psserver.members.member_checks), its ``protos`` keep GetStats' epochs (psserver.members.timeline_protos).  What a
membership change does to the slice -- forgetting a process's sequence numbers, closing a round that no longer
waits for anyone -- stays with the shard, which calls this under its lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

from psserver.common.logsafe import shorten
from psserver.members.epochs import EpochBook, JoinBackoff, TimelineFull, join_patience
from psserver.members.member_checks import MemberChecks
from psserver.members.membership import Membership
from psserver.members.timeline_protos import TimelineProtos
from psserver.protocol.epochs import epoch_at
from psserver.protocol.errors import JobFull, TooBusy
from psserver.protocol.job import JobSpec
from psserver.sparse.serving import Membership as TableMembers
from psserver.state import modes

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split
MAX_MISSING_LISTED = 10  # ranks named in a "still waiting for" message; the rest are counted


class Enrolment:
    """The membership of shard ``shard_id`` (partition ``partition``): handed the shard's counters and its
    ``changed`` callback (wakes waiters) at construction."""

    def __init__(self, shard_id: int, partition: int, label: str, clock: Callable[[], float],
                 lease_timeout: float, counters: Counter, changed: Callable[[], None], join_timeout: float = 0.0):
        self.shard_id, self.partition, self.label = shard_id, partition, label
        self._info = log.info if partition == 0 else log.debug  # lifecycle lines once per shard, not per partition
        self._clock = clock
        self.lease_timeout = lease_timeout
        self.join_timeout = join_patience(join_timeout, lease_timeout)  # a pending join's hold (psserver.members.epochs)
        self._counters = counters
        self._changed = changed
        self.members = Membership(clock, lease_timeout)
        self.checks = MemberChecks(shard_id, label, self.members, lambda: self.epochs, counters, changed)
        self.handoff_held_from: int | None = None  # a live re-shard's hold (psserver.resharding.handoff.shard_ops), beside the joins'
        self.reset()

    def reset(self) -> None:
        """No job: nobody registered, no timeline."""
        self.started = False  # every trainer of the job has registered at least once
        self.epochs: EpochBook | None = None  # the membership timeline and pending joins (psserver.members.epochs)
        self.protos = TimelineProtos()  # GetStats' epochs, by the timeline they were built from
        self.refused_registers: dict[int, str] = {}  # rank -> why its last Register was refused (before the start)
        self.members.reset()

    def start(self, job: JobSpec) -> None:
        self.epochs = EpochBook(job.num_trainers, job.max_trainers, self.label)

    def check_base(self, job: JobSpec, rank: int, base: int) -> None:
        """MemberChecks.check_base, for the step engine's pushes (psserver.members.member_checks)."""
        self.checks.check_base(job, rank, base)

    # ------------------------------------------------------------------ changes
    def register(self, rank: int, trainer_id: str, job: JobSpec, version: int) -> tuple[bool, int, int]:
        """Record a registration; returns (a new process took over the rank, registered count, the round a rank
        that was out of the epoch -- it left -- is a member from again, else 0)."""
        epoch = self.epochs.registered(rank, at=version)  # first: refused past MAX_EPOCHS, nothing changed
        previous = self.members.register(rank, trainer_id)
        self.refused_registers.pop(rank, None)
        self._counters["registrations"] += 1
        replaced = previous is not None and previous != trainer_id
        if replaced:
            self._counters["re_registrations"] += 1
            self._info("shard %d: rank %d re-registered as %s (was %s)", self.shard_id, rank,
                       shorten(trainer_id), shorten(previous))
        if epoch is not None:
            self.epoch_changed(epoch, f"rank {rank} registered without --join")
        view = self.members.view()
        if not self.started and len(view.registered) >= job.num_trainers:
            self.started = True
        if previous is None:
            self._info("shard %d: rank %d registered as %s (%d/%d)", self.shard_id, rank, shorten(trainer_id),
                       len(view.registered), job.num_trainers)
        return replaced, len(view.registered), epoch.round if epoch is not None else 0

    def join(self, rank: int, trainer_id: str, join_round: int, version: int,
             confirm: bool = False, exact: bool = True, peer: str = "") -> tuple[int, int, bool]:
        """An elastic join's step (docs/design/elastic-join.md): ``join_round`` 0 asks for admission, E commits it, E with
        ``confirm`` ends the hold once every shard committed; ``exact`` (sync) keeps E to the window (else it
        is clamped into it, psserver.members.epochs).  Returns (rank, the round answered -- a commit's: the round it
        took -- and whether a new process took over the rank)."""
        if join_round == 0:
            hands_out = self.shard_id == 0 and self.partition == 0
            try:
                pending = self.epochs.prepare(None if hands_out else rank, trainer_id, version,
                                              self._clock(), self.join_timeout, peer)
            except JoinBackoff:
                self._counters["joins_refused_backoff"] += 1
                raise
            except TooBusy:
                self._counters["joins_refused_pending"] += 1
                raise
            rank = self.epochs.rank_of(trainer_id)
            self._counters["join_requests"] += 1
            self._info("shard %d: %s asks to join as rank %d: proposed round %d, rounds from %d held",
                       self.shard_id, shorten(trainer_id), rank, pending.proposal, pending.held_from)
            answer = pending.proposal
        else:
            self._check_not_taken(rank, trainer_id)
            before = self.epochs.timeline
            if confirm:
                epoch = self.epochs.confirm(rank, trainer_id, join_round, version, self._clock(), exact)
                self._counters["joins_confirmed"] += 1
            else:
                epoch = self.epochs.commit(rank, trainer_id, join_round, version, self._clock(), self.join_timeout,
                                           exact)
            if self.epochs.timeline is not before:  # not a retry (or a confirm that the commit came before)
                self._counters["joins"] += 1
                self.epoch_changed(epoch, f"rank {rank} joined")
            answer = epoch.round
        replaced = self.members.register(rank, trainer_id) not in (None, trainer_id)
        return rank, answer, replaced

    def _check_not_taken(self, rank: int, trainer_id: str) -> None:
        """A commit or confirm answered again (its join is in the timeline already) only to the same process."""
        holder = self.members.members().get(rank)
        pending = self.epochs.pending.get(rank)
        if pending is None and holder not in (None, trainer_id) and self.epochs.joined_at(rank) is not None:
            raise JobFull(f"rank {rank} joined this job as {shorten(holder)}, not {shorten(trainer_id)}: "
                          "ask for admission again (join_round 0)")

    def leave(self, rank: int, at: int) -> int:
        """``rank`` said goodbye; out of the epochs from round ``at``.  Returns the live count left."""
        epoch = self._leave_epoch(rank, at)
        if epoch is not None:
            self.epoch_changed(epoch, f"rank {rank} left")
        remaining = self.members.leave(rank)
        self._counters["leaves"] += 1
        self._info("shard %d: rank %d left; %d live", self.shard_id, rank, remaining)
        return remaining

    def leaving_with(self, rank: int, version: int) -> list | None:
        """A push announcing its trainer's leave: out of the epoch from round ``version + 1``.  Returns the
        timeline before (``put_back`` if the push is refused), or None if nothing changed (already out)."""
        before = list(self.epochs.timeline)
        epoch = self._leave_epoch(rank, version + 1)
        if epoch is None:
            return None
        self._counters["leaves_announced"] += 1
        self.epoch_changed(epoch, f"rank {rank} pushed its last gradient")
        return before

    def _leave_epoch(self, rank: int, at: int):
        """The epoch a leave starts, or None.  A leave is never refused: past MAX_EPOCHS it starts no epoch and
        is taken as a lease expiry would be (the rank stays a member; rounds stop waiting for it through the
        live set), counted in ``leaves_past_max_epochs`` and logged."""
        try:
            return self.epochs.leave(rank, at)
        except TimelineFull as e:
            self._counters["leaves_past_max_epochs"] += 1
            log.warning("shard %d: rank %d leaves without a new membership epoch: %s", self.shard_id, rank, e)
            return None

    def put_back(self, timeline: list) -> None:
        self.epochs.restore_timeline(timeline)

    def expire(self, version: int | None = None) -> list:
        """Drop joins not settled in time and silent trainers' leases; returns the (rank, silence) dropped.
        ``version``: the shard's (a withdrawn join's epoch goes only from rounds not served yet: psserver.members.epochs)."""
        for rank, pending in self.epochs.expire(self._clock(), version):
            if self.members.holds(rank, pending.trainer_id):  # not a trainer that registered the rank since
                self.members.leave(rank)
            if pending.committed:
                self._counters["joins_unconfirmed"] += 1
                log.warning("shard %d: %s committed its join as rank %d from round %d but did not confirm within "
                            "%.1f s: withdrawn (membership epoch %d from round %d), round %d no longer held",
                            self.shard_id, shorten(pending.trainer_id), rank, pending.committed, self.join_timeout,
                            self.epochs.current.number, self.epochs.current.round, pending.committed - 1)
                continue
            self._counters["joins_abandoned"] += 1
            log.warning("shard %d: %s asked to join as rank %d but did not commit within %.1f s: dropped (its peer "
                        "%s waits before its next admission)", self.shard_id, shorten(pending.trainer_id), rank,
                        self.join_timeout, shorten(pending.peer) or "?")
        gone = self.members.expire()
        for rank, silent in gone:
            self._counters["lease_expired"] += 1
            log.warning("shard %d: rank %d silent for %.1f s (lease %.1f s): dropped from the live set",
                        self.shard_id, rank, silent, self.lease_timeout)
        return gone

    def epoch_changed(self, epoch, why: str) -> None:
        self._counters["membership_epochs"] += 1
        self._info("shard %d: %s: membership epoch %d from round %d: ranks %s", self.shard_id, why, epoch.number,
                   epoch.round, sorted(epoch.members)[:MAX_MISSING_LISTED])

    # ------------------------------------------------------------------ reads
    def done(self, job: JobSpec | None) -> bool:
        """Every trainer of the job registered and all have left (said goodbye, not merely gone silent)."""
        if job is None or not self.started:
            return False
        view = self.members.view()
        return not view.live and view.registered <= view.left

    def deadlines(self) -> list:
        return [self.members.next_expiry(), self.epochs.next_deadline()]

    def table_members(self) -> TableMembers:
        """The membership a table's round reads: the live set, and the timeline that says who each round expects
        (one boundary for the dense round and the tables, psserver.sparse.serving.Membership)."""
        return TableMembers(frozenset(self.members.view().live), self.started, self.epochs, self.handoff_held_from)

    def joins_at(self, rank: int, round_: int) -> bool:
        """Whether ``rank`` is a member from round ``round_`` and was not in the round before (a joiner's first
        round: its table pulls wait for the close of the one before).  Lock-free callers (a pull's check on
        the event loop) read a copy of the timeline."""
        book = self.epochs
        if book is None or round_ <= 0:
            return False
        timeline = list(book.timeline)
        return rank in epoch_at(timeline, round_).members and rank not in epoch_at(timeline, round_ - 1).members

    def round_view(self, version: int, round_, last_base: dict) -> modes.RoundView:
        book = self.epochs
        held = book.held_from()
        if self.handoff_held_from is not None:
            held = self.handoff_held_from if held is None else min(held, self.handoff_held_from)
        return modes.RoundView(
            version=version,
            live=book.expected(self.members.view().live, version),  # the live members of this round's epoch
            held=held is not None and version >= held,
            members=len(book.members_at(version)),
            started=self.started,
            contributors=round_.contributors,  # not copied: decisions only read them
            stale_in_round=round_.stale,
            opened_at=round_.opened_at,
            last_base=last_base,
        )

    def timeline(self) -> list:
        book = self.epochs
        return list(book.timeline) if book is not None else []

    def timeline_proto(self, members_from_round: int) -> list:
        """GetStats' ``epochs``, kept until the timeline changes (psserver.members.timeline_protos)."""
        return self.protos.of(self.epochs, members_from_round)

    def epoch_number(self, version: int) -> int:
        """The membership epoch in effect at round ``version`` (what a pull of that version tells)."""
        book = self.epochs
        return epoch_at(book.timeline, version).number if book is not None else 0

    def members_at(self, version: int) -> int:
        return len(self.epochs.members_at(version))

    def missing_registrations(self, num_trainers: int) -> str:
        """The ranks not registered yet, named up to ``MAX_MISSING_LISTED``; then why the first of them whose
        Register was refused was refused: the trainers that wait for it learn that it came with other flags."""
        missing = sorted(set(range(num_trainers)) - self.members.view().registered)
        named = ", ".join(map(str, missing[:MAX_MISSING_LISTED]))
        more = f" and {len(missing) - MAX_MISSING_LISTED} more" if len(missing) > MAX_MISSING_LISTED else ""
        refused = next((r for r in missing if r in self.refused_registers), None)
        why = f"; a Register as rank {refused} was refused: {self.refused_registers[refused]}" \
            if refused is not None else ""
        return f"[{named}]{more} to register{why}"

    def register_refused(self, rank: int, num_trainers: int, why: str) -> None:
        """A Register as ``rank`` of the running job was refused for ``why``: kept, for a rank the job still
        waits for, until it registers (one line a rank; the job's ranks only, so the book stays bounded)."""
        if not self.started and 0 <= rank < num_trainers:
            self.refused_registers[rank] = why[:300]

    def digest_text(self) -> str:
        return self.epochs.digest_text() if self.epochs is not None else ""

    def restore(self, members: dict, epochs: list | None, num_trainers: int) -> None:
        self.members.restore(members)
        self.epochs.restore(epochs)
        self.started = len(members) >= num_trainers
