"""The refusals of a shard's membership (docs/security.md): a Register naming the wrong shard or rank, a stranger or
another job's trainer, a digest asked for by a non-member, a push or row call from outside the epoch of its round.
Apart from Enrolment, which changes the membership, because these only read it (leases, the epoch timeline), most
on the event loop; the one change a check makes is a lease renewed."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

from psserver.common.logsafe import counted, shorten
from psserver.members.epochs import EpochBook
from psserver.members.membership import Membership
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotPermitted, NotReady
from psserver.protocol.job import JobSpec
from psserver.protocol.rules import Mode

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class MemberChecks:
    """The checks of shard ``shard_id``'s membership: handed its leases, a read of its epoch book (replaced when a
    job starts or goes), its counters and its ``changed`` callback (wakes waiters)."""

    def __init__(self, shard_id: int, label: str, members: Membership, book: Callable[[], EpochBook | None],
                 counters: Counter, changed: Callable[[], None]):
        self.shard_id, self.label, self.members = shard_id, label, members
        self._book, self._counters, self._changed = book, counters, changed

    def check_register(self, rank: int, expected_shard: int, job: JobSpec, join: bool = False) -> None:
        """Refuse a registration on what it says alone (shard order, shard count, rank), before anything of it
        is made -- here or, by ShardHost, the partitions of its job."""
        if expected_shard != self.shard_id:
            raise JobMismatch(
                f"this is shard {self.shard_id} but the trainer listed it as shard {expected_shard}: "
                "--ps must list the shards in shard order"
            )
        if job.num_shards <= self.shard_id:
            raise JobMismatch(f"this is shard {self.shard_id} but the job has only {counted(job.num_shards, 'shard')}")
        if join or (job.max_trainers and 0 <= rank < job.max_trainers):
            return  # the job's epochs decide (psserver.members.epochs)
        if not 0 <= rank < job.num_trainers:
            raise InvalidRequest(
                f"rank is {rank} but the job has {counted(job.num_trainers, 'trainer')} "
                f"(ranks 0..{job.num_trainers - 1})")

    def check_member(self, job: JobSpec | None, rank: int, trainer_id: str, fingerprint: str) -> None:
        """Refuse strangers and other jobs' trainers; renew the caller's lease.  Safe on the event loop: only
        the membership's lock is taken."""
        if job is None:
            raise NotReady(f"{self.label} has no job yet: register first")
        if fingerprint != job.fingerprint:
            raise JobMismatch(
                f"fingerprint is {shorten(fingerprint)} but the job's is {shorten(job.fingerprint)}: a different "
                "model or shard count"
            )
        if self.members.check(rank, trainer_id, self.shard_id):
            self._counters["rejoins"] += 1
            log.info("shard %d: rank %d is heard from again after its lease expired: live again", self.shard_id, rank)
            self._changed()

    def is_member(self, job: JobSpec | None, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """A read: no lease is renewed, nothing is counted.  Safe on the event loop."""
        return job is not None and fingerprint == job.fingerprint and self.members.holds(rank, trainer_id)

    def check_digest_caller(self, job: JobSpec | None, rank: int, trainer_id: str, fingerprint: str) -> None:
        """Refuse a state digest to all but the job's members: it is a pass over the whole state, tables
        included, so not work a stranger may ask for.  A read (no lease is renewed); with no job there is
        nothing to hash.  Safe on the event loop."""
        if job is None or self.is_member(job, rank, trainer_id, fingerprint):
            return
        raise NotPermitted(
            f"with_digest is set but rank {rank} as {shorten(trainer_id)} with fingerprint {shorten(fingerprint)} "
            f"is not a member of the job on {self.label}: a digest needs membership (rank, trainer_id and "
            "fingerprint of a registered trainer) or the shard's token")

    def check_base(self, job: JobSpec, rank: int, base: int) -> None:
        """In an elastic job a push's base must be a round of the rank's membership."""
        book = self._book()
        if job.max_trainers and rank not in book.members_at(base):
            if rank not in book.current.members:
                # A joiner admitted but not committed (or one that never commits) is in no epoch: its gradients
                # are no round's (they were summed into one); refused until its commit names its round.
                raise _in_no_epoch(rank, base)
            raise JobMismatch(f"base version is {base} but rank {rank} is a member of this job from round "
                              f"{min(e.round for e in book.timeline if rank in e.members and e.round > base)} "
                              "(its join): pull that version first")

    def check_table_base(self, job: JobSpec, rank: int, base: int, mode: str) -> None:
        """A table push must come from a rank of the epoch of the round it enters, as a dense push must
        (``check_base``): a sync table's version is the job's round, so its base is checked as a dense base is;
        an async or stale-timeout table's version is not, so there only a joiner not yet committed (in no
        epoch) is refused -- before, its rows were summed into the round (docs/security.md)."""
        if not job.max_trainers:
            return
        if mode == Mode.SYNC:
            self.check_base(job, rank, base)
        elif rank in self._book().pending and not self._book().pending[rank].committed:
            raise _in_no_epoch(rank, base)

    def check_row_pull(self, job: JobSpec | None, rank: int, min_version: int) -> None:
        """A PullRows creates the rows it names (lazily): a joiner admitted but not committed (in no epoch, and
        perhaps never in one) may not, as it may not push.  Lock-free: the pending joins and the timeline are
        read as they are (each changed by one swap or one dict update under the shard's lock)."""
        book = self._book()
        if job is None or not job.max_trainers or book is None:
            return
        pending = book.pending.get(rank)
        if pending is not None and not pending.committed and rank not in book.current.members:
            raise JobMismatch(f"rank {rank} is in no membership epoch of this job (min_version is {min_version}): "
                              "a joiner pulls rows only after its commit (Register with join_round, "
                              "docs/design/elastic-join.md)")


def _in_no_epoch(rank: int, base: int) -> JobMismatch:
    return JobMismatch(f"rank {rank} is in no membership epoch of this job (base version is {base}): a joiner "
                       "pushes only after its commit (Register with join_round, docs/design/elastic-join.md)")
