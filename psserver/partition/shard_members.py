"""Who is in a shard's job: registering, an elastic join, leaving, and the checks of a caller's membership.

``Admission`` is a room of ``Shard`` (psserver.partition.shard makes it), its own because who may call is a question apart
from what a call does: each method fixes or checks the job -- under the shard's lock, or lock-free where it says
it is safe on the event loop -- and hands on to the enrolment (psserver.members.enrolment), which decides.  The job
and the books it reads are the shard's, read at each call; fixing and clearing the job are the shard's too,
handed here as ``fix_job`` and ``clear_job``.  A leave announced with a push (``leaving_with``) is here too: the
push path (psserver.partition.shard_pushes) asks it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from psserver.common.logsafe import shorten
from psserver.members.epochs import no_job_to_join
from psserver.protocol.errors import JobMismatch, NotReady
from psserver.protocol.job import JobSpec
from psserver.protocol.rules import Mode
from psserver.state import modes

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class Admission:
    """Register, join, leave, the member checks and the membership timeline: ``Shard``'s face to its enrolment."""

    def __init__(self, shard, lock: threading.RLock, clock: Callable[[], float], changed: Callable[[], None],
                 info: Callable[..., None], rounds, fix_job: Callable[[JobSpec], None], clear_job: Callable[[], None]):
        """``shard``: the psserver.partition.shard.Shard whose job this admits to (not imported: it imports this);
        ``rounds``: its psserver.partition.shard_rounds.Rounds (a leave or a join may close a round); ``info``: the
        shard's lifecycle log (info on partition 0, debug elsewhere)."""
        self.shard = shard
        self._lock, self._clock, self._changed, self._info = lock, clock, changed, info
        self._rounds, self._fix_job, self._clear_job = rounds, fix_job, clear_job
        self._enrolment = shard.enrolment

    def register(self, rank: int, trainer_id: str, expected_shard: int, job: JobSpec, join: bool = False,
                 join_round: int = 0, join_confirm: bool = False, peer: str = "") -> dict:
        """Join ``rank`` to the job; the first registration fixes the job spec.

        A job whose every trainer registered and then left has ended: the next registration starts a new job
        from scratch (the shard does not carry the old weights into it).  A refused registration changes
        nothing.  ``join``: a trainer joining a running elastic job (``join_elastic``); ``peer``: the host it
        calls from (psserver.members.epochs.PeerStrikes).
        """
        self.check_register(rank, expected_shard, job, join)
        if join:
            return self.join_elastic(rank, trainer_id, job, join_round, join_confirm, peer)
        s = self.shard
        with self._lock:
            if s.job is not None and self.job_ended():
                self._info("shard %d: job %s ended (every trainer left); %s starts a new job from scratch",
                           s.shard_id, shorten(s.job.job_id or "(unnamed)"), shorten(job.job_id or "(unnamed)"))
                s.counters["jobs_ended"] += 1
                self._clear_job()
            if s.job is None:
                self._fix_job(job)
            else:
                self._check_same_job(job)
            replaced, registered, member_from = self._enrolment.register(rank, trainer_id, job, s.version)
            if replaced:
                s.pushes.new_process(rank)
            self._changed()
            return dict(
                shard=s.shard_id, start=s.start, end=s.end, initialized=s.params is not None,
                version=s.version, registered=registered, lease_seconds=s.lease_timeout,
                join_round=member_from,  # a rank that left, registered again: its first round (its table lanes')
            )

    def join_elastic(self, rank: int, trainer_id: str, job: JobSpec, join_round: int, confirm: bool = False,
                     peer: str = "") -> dict:
        """A join (docs/design/elastic-join.md): ``join_round`` 0 asks for admission -- a rank (partition 0 of shard 0 hands
        one out; elsewhere ``rank`` names it) and this shard's proposed round, holding later rounds until the
        join is settled; ``join_round`` E commits it from round E (holding round E - 1) and ``confirm`` ends the
        hold once every shard took the commit.  Refused, changing nothing, by the job
        (not elastic, full) or an E outside the window (psserver.protocol.epochs.commit_window)."""
        s = self.shard
        with self._lock:
            if s.job is None or self.job_ended():
                raise no_job_to_join(s.label, ended=s.job is not None)
            diff = s.job.joiner_difference(job)
            if diff:
                raise JobMismatch(f"job spec differs from the one this shard runs: {diff}")
            rank, answer, replaced = self._enrolment.join(rank, trainer_id, join_round, s.version, confirm,
                                                          exact=s.job.mode == Mode.SYNC, peer=peer)
            if replaced:
                s.pushes.new_process(rank, holes=False)  # a new process on a rank that left
            self._rounds.close_if_due()
            s.tables.close_due(self._enrolment.table_members(), self._clock())  # a table round it held
            self._changed()
            view = s.members.view()
            return dict(shard=s.shard_id, start=s.start, end=s.end, initialized=s.params is not None,
                        version=s.version, registered=len(view.registered), lease_seconds=s.lease_timeout,
                        rank=rank, join_round=answer, membership_epoch=s.epochs.current.number)

    def _check_same_job(self, job: JobSpec) -> None:
        diff = self.shard.job.difference(job)
        if diff:
            raise JobMismatch(f"job spec differs from the one this shard runs: {diff}")

    def epoch_timeline(self) -> list:
        return self._enrolment.timeline()

    def epoch_timeline_proto(self, members_from_round: int) -> list:
        return self._enrolment.timeline_proto(members_from_round)

    def epoch_number(self, version: int) -> int:
        """The membership epoch in effect at round ``version`` (what a pull of that version tells)."""
        return self._enrolment.epoch_number(version)

    def check_register(self, rank: int, expected_shard: int, job: JobSpec, join: bool = False) -> None:
        """Refuse a registration on what it says alone (psserver.members.enrolment), before anything of it is made."""
        self._enrolment.checks.check_register(rank, expected_shard, job, join)

    def leave(self, rank: int, trainer_id: str, fingerprint: str) -> int:
        """``rank`` is done and forgotten; rounds stop waiting for it. Returns the live count left."""
        s = self.shard
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            # Out from the round after its last gradient: the open one if it is in it, else the open one
            at = s.version + 1 if rank in s.round.contributors else s.version
            remaining = self._enrolment.leave(rank, at)
            s.pushes.forget(rank)
            s.cursor.leave(rank)
            self._rounds.close_if_due()
            s.tables.close_due(self._enrolment.table_members(), self._clock())
            self._changed()
            return remaining

    def job_done(self) -> bool:
        """Every trainer of the job registered and all have left (said goodbye, not merely gone silent)."""
        with self._lock:
            return self.job_ended()

    def job_ended(self) -> bool:
        """``job_done`` without the lock: under it, or a pre-check on the event loop (the membership has its own
        lock)."""
        return self._enrolment.done(self.shard.job)

    def register_refused(self, rank: int, why: str) -> None:
        """A Register as ``rank`` was refused for ``why`` (a spec that differs): told to the trainers waiting.
        On the event loop, without the lock (as the Register's other checks): one dict entry written."""
        job = self.shard.job
        if job is not None:
            self._enrolment.register_refused(rank, job.num_trainers, why)

    def check_member(self, rank: int, trainer_id: str, fingerprint: str, need_params: bool = False) -> None:
        """Refuse strangers and other jobs' trainers; renew the caller's lease.  Safe on the event loop."""
        s = self.shard
        self._enrolment.checks.check_member(s.job, rank, trainer_id, fingerprint)
        if need_params and s.params is None:
            raise NotReady(f"{s.label} is not initialised yet: rank 0 sends Init first")

    def is_member(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """Is the caller a registered trainer of the running job?  A read.  Safe on the event loop."""
        return self._enrolment.checks.is_member(self.shard.job, rank, trainer_id, fingerprint)

    def check_digest_caller(self, rank: int, trainer_id: str, fingerprint: str) -> None:
        """Refuse a state digest to all but the job's members (psserver.members.enrolment).  Safe on the event loop."""
        self._enrolment.checks.check_digest_caller(self.shard.job, rank, trainer_id, fingerprint)

    def heartbeat(self, rank: int, trainer_id: str, fingerprint: str) -> tuple[int, int]:
        """Renew ``rank``'s lease. Returns (version, live count). Safe on the event loop."""
        self.check_member(rank, trainer_id, fingerprint)
        return self.shard.version, len(self.shard.members.view().live)

    def leaving_with(self, rank: int, d: modes.PushDecision) -> list | None:
        """A push announcing the trainer's leave (docs/elastic.md): the rank is out of the epoch from the round
        after this one.  Done before the push is carried out, so no reply of the next version -- the one this
        push may close the round into -- names the old epoch, and the others split that round's data without
        the leaver.  Returns the timeline before (to put back if the push is refused), or None if nothing
        changed (a duplicate, a dropped gradient, already out)."""
        if d.action not in (modes.Action.ACCUMULATE, modes.Action.APPLY, modes.Action.SKIP_IN_ROUND):
            return None
        return self._enrolment.leaving_with(rank, self.shard.version)
