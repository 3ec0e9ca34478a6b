"""One shard's state: a slice of the parameters, its optimizer, its version, its job and members.

A shard owns a contiguous slice of the flat parameter vector, that slice's
optimizer state, a version counter (optimizer steps applied), the job spec, and
the membership of trainers.  It knows nothing of the model's code, nor of gRPC.
A push is decided by psserver.modes and carried out by psserver.executor, for
which the shard is a ``PushTarget`` (the hooks say what a dense gradient is).

Why ``Shard`` is long (~600 lines): membership, the dense slice, its checkpoints and its stats share one lock
and one state; splitting them is the next step of issue 19 (the lifecycle, the slice, checkpoint/restore).

Threads: every method that touches tensors or the round is synchronous and is
meant to run on the server's one *state worker* thread (psserver.server), so
they never contend; ``_lock`` still guards them for tests and the checkpoint
writer.  Nothing here waits: a pull that needs a newer version is waited for by
the async server, which ``on_change`` (a constructor argument) wakes.  Membership (leases, heartbeats)
has its own lock (psserver.membership) so the event loop can renew a lease
without waiting behind a step.  Lock order: ``_lock`` then the membership's.

Reads that the event loop makes without ``_lock`` (``version``, ``params is
None``, ``job``, ``snapshot()``) are single attribute reads or C-level dict
copies, atomic under the GIL; they may be a step behind, never torn.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from psserver import modes
from psserver.checkpoint import Checkpointer, CheckpointWriter, ShardState
from psserver.common.logsafe import counted, shorten
from psserver.epochs import EpochBook
from psserver.executor import PushInfo, PushTarget, check_sequence, execute, record_ack
from psserver.membership import Membership
from psserver.metrics import ShardMetrics
from psserver.protocol.codec import TORCH_DTYPES
from psserver.protocol.epochs import epoch_at, lr_factor
from psserver.protocol.errors import (
    FutureVersion,
    InvalidRequest,
    JobMismatch,
    NoJobToJoin,
    NotPermitted,
    NotReady,
    StaleGradient,
)
from psserver.protocol.job import WIRE_DTYPES, JobSpec
from psserver.protocol.layout import partition_range
from psserver.protocol.limits import check_num_samples
from psserver.slice_optim import SliceOptimizer
from psserver.protocol.rules import Mode
from psserver.protocol.schedules import lr_at
from psserver.rounds import OpenRound
from psserver.snapshots import SnapshotPool
from psserver.stats import StatsSnapshot
from psserver.sparse.serving import Membership as TableMembers
from psserver.sparse.serving import RowsPush, RowsResult, Tables

log = logging.getLogger(__name__)
MAX_MISSING_LISTED = 10  # ranks named in a "still waiting for" message; the rest are counted


@dataclass(frozen=True)
class Prepared:
    """What a job's first Register made for this partition before the job was recorded (psserver.host):
    its dense slice's memory, and on partition 0 its tables."""

    job: JobSpec
    buffer: torch.Tensor  # the slice's parameters, uninitialised: Init copies into it
    tables: Tables | None = None


@dataclass(frozen=True)
class PushResult:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled" | "skipped"
    version: int
    staleness: int


class Shard(PushTarget):
    """State of shard ``shard_id``."""

    def __init__(self, shard_id: int, clock: Callable[[], float] = time.monotonic, lease_timeout: float = 5.0,
                 checkpointer: Checkpointer | None = None, partition: int = 0, metrics: ShardMetrics | None = None,
                 on_change: Callable[["Shard"], None] = lambda part: None):
        """``metrics``: the registry this shard observes into (its host's, shared by every partition; a shard of
        its own makes one over its own snapshot).  ``on_change(shard)``: called on every change of the state a
        waiting pull or the round timer may be waiting for, from the thread that made it (the server wakes its
        waiters with it, psserver.runtime.Wakeups)."""
        self.shard_id = shard_id
        # Partition k > 0 of a partitioned job (psserver.host) is a Shard of its own for the range of its piece;
        # only partition 0 holds the sparse tables, and all share partition 0's metrics registry.
        self.partition = partition
        self.label = f"shard {shard_id}" + (f" partition {partition}" if partition else "")  # in messages
        self._info = log.info if partition == 0 else log.debug  # lifecycle lines once per shard, not per partition
        self._clock = clock
        self.lease_timeout = lease_timeout
        self.checkpointer = checkpointer
        self._on_change = on_change
        self._lock = threading.RLock()
        # Guards the snapshot pool, ``_stepping`` and the (version, parameters) pair a pull reads.  Held only
        # for bookkeeping, never for tensor work, so the event loop may try it without waiting
        # (``try_acquire_snapshot``): a round's worth of pulls then costs no hop to the state worker.
        self._snap_lock = threading.Lock()
        self._stepping = False  # an optimizer step is writing the parameters
        self.members = Membership(clock, lease_timeout)
        self.counters: Counter[str] = Counter()
        self.metrics = metrics if metrics is not None else ShardMetrics(shard_id, self.snapshot)
        self._writer = (CheckpointWriter(checkpointer, self._checkpoint_written) if checkpointer is not None
                        else None)
        if checkpointer is not None and checkpointer.orphans_removed:
            self.counters["checkpoint_orphans_removed"] += checkpointer.orphans_removed
        self._stopped = False
        self.prepared: Prepared | None = None  # set by the host when a job is admitted, taken by _set_job
        self._clear_job()

    def _clear_job(self) -> None:
        """No job: the state a shard starts in, and returns to when a job ended."""
        self.params: torch.nn.Parameter | None = None  # first: lock-free readers test it before the job
        self.job: JobSpec | None = None
        self._buffer: torch.Tensor | None = None  # the slice's memory, made at Register, filled by Init
        self._cfg: modes.ModeConfig | None = None
        self.start = self.end = 0
        self.optimizer: SliceOptimizer | None = None
        self.version = 0
        self.started = False  # every trainer of the job has registered at least once
        self.round = OpenRound()  # sync modes only
        self._last_base: dict[int, int] = {}
        self._acked: dict[int, tuple[str, int, PushResult]] = {}  # rank -> (trainer id, sequence, result)
        self._holes: dict[int, frozenset[int]] = {}  # rank -> numbers below its newest not seen yet (push window)
        self.snapshots = SnapshotPool()
        self.tables = Tables()  # sparse tables (psserver.sparse.serving): their own versions and rounds
        self.epochs: EpochBook | None = None  # the membership timeline and pending joins (psserver.epochs)
        self.members.reset()

    # ------------------------------------------------------------------ membership and job
    def register(self, rank: int, trainer_id: str, expected_shard: int, job: JobSpec, join: bool = False,
                 join_round: int = 0) -> dict:
        """Join ``rank`` to the job; the first registration fixes the job spec.

        A job whose every trainer registered and then left has ended: the next
        registration starts a new job from scratch (the shard does not carry the
        old weights into it).  A refused registration changes nothing.
        ``join``: a trainer joining a running elastic job (``join_elastic``).
        """
        self.check_register(rank, expected_shard, job, join)
        if join:
            return self.join_elastic(rank, trainer_id, job, join_round)
        with self._lock:
            if self.job is not None and self._job_done():
                self._info("shard %d: job %s ended (every trainer left); %s starts a new job from scratch",
                         self.shard_id, shorten(self.job.job_id or "(unnamed)"), shorten(job.job_id or "(unnamed)"))
                self.counters["jobs_ended"] += 1
                self._clear_job()
            if self.job is None:
                self._set_job(job)
            else:
                diff = self.job.difference(job)
                if diff:
                    raise JobMismatch(f"job spec differs from the one this shard runs: {diff}")
            previous = self.members.register(rank, trainer_id)
            self.counters["registrations"] += 1
            if previous is not None and previous != trainer_id:
                self.counters["re_registrations"] += 1
                self._acked.pop(rank, None)  # a new process: its sequence numbers start afresh
                self._holes.pop(rank, None)
                self._info("shard %d: rank %d re-registered as %s (was %s)", self.shard_id, rank,
                         shorten(trainer_id), shorten(previous))
            epoch = self.epochs.registered(rank, at=self.version)
            if epoch is not None:
                self._epoch_changed(epoch, f"rank {rank} registered without --join")
            view = self.members.view()
            if not self.started and len(view.registered) >= job.num_trainers:
                self.started = True
            if previous is None:
                self._info("shard %d: rank %d registered as %s (%d/%d)", self.shard_id, rank, shorten(trainer_id),
                         len(view.registered), job.num_trainers)
            self._changed()
            return dict(
                shard=self.shard_id, start=self.start, end=self.end, initialized=self.params is not None,
                version=self.version, registered=len(view.registered), lease_seconds=self.lease_timeout,
            )

    def join_elastic(self, rank: int, trainer_id: str, job: JobSpec, join_round: int) -> dict:
        """A join (docs/elastic.md): ``join_round`` 0 asks for admission -- a rank (partition 0 of shard 0 hands
        one out; elsewhere ``rank`` names it) and this shard's proposed round, holding later rounds until the
        join is settled; ``join_round`` E commits it from round E.  Refused, changing nothing, by the job
        (not elastic, full) or an E outside the window (psserver.protocol.epochs.commit_window)."""
        with self._lock:
            if self.job is None or self._job_done():
                raise NoJobToJoin(f"{self.label} runs no job to join: start the job first (its trainers register "
                               "without --join)")
            diff = self.job.difference(job)
            if diff:
                raise JobMismatch(f"job spec differs from the one this shard runs: {diff}")
            if join_round == 0:
                hands_out = self.shard_id == 0 and self.partition == 0
                pending = self.epochs.prepare(None if hands_out else rank, trainer_id, self.version,
                                              self._clock(), self.lease_timeout)
                rank = self.epochs.rank_of(trainer_id)
                self.counters["join_requests"] += 1
                self._info("shard %d: %s asks to join as rank %d: proposed round %d, rounds from %d held",
                           self.shard_id, shorten(trainer_id), rank, pending.proposal, pending.held_from)
                answer = pending.proposal
            else:
                epoch = self.epochs.commit(rank, trainer_id, join_round, self.version)
                self.counters["joins"] += 1
                self._epoch_changed(epoch, f"rank {rank} joined")
                answer = join_round
            if self.members.register(rank, trainer_id) not in (None, trainer_id):
                self._acked.pop(rank, None)  # a new process on a rank that left: its sequence numbers start afresh
            self._close_if_due()
            self._changed()
            view = self.members.view()
            return dict(shard=self.shard_id, start=self.start, end=self.end, initialized=self.params is not None,
                        version=self.version, registered=len(view.registered), lease_seconds=self.lease_timeout,
                        rank=rank, join_round=answer, membership_epoch=self.epochs.current.number)

    def _epoch_changed(self, epoch, why: str) -> None:
        self.counters["membership_epochs"] += 1
        self._info("shard %d: %s: membership epoch %d from round %d: ranks %s", self.shard_id, why, epoch.number,
                   epoch.round, sorted(epoch.members)[:MAX_MISSING_LISTED])

    def epoch_timeline(self) -> list:
        book = self.epochs
        return list(book.timeline) if book is not None else []

    def epoch_number(self, version: int) -> int:
        """The membership epoch in effect at round ``version`` (what a pull of that version tells)."""
        book = self.epochs
        return epoch_at(book.timeline, version).number if book is not None else 0

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
            return  # the job's epochs decide (psserver.epochs)
        if not 0 <= rank < job.num_trainers:
            raise InvalidRequest(
                f"rank is {rank} but the job has {counted(job.num_trainers, 'trainer')} "
                f"(ranks 0..{job.num_trainers - 1})")

    def _set_job(self, job: JobSpec) -> None:
        """Fix ``job``: everything it needs is made before any of it is recorded, so a failure (a table that
        does not fit, RESOURCE_EXHAUSTED) leaves the shard without a job, not with half of one.  What the host
        prepared for ``job`` (``Prepared``: made at admission, under the memory budget) is taken, not made again."""
        prep, self.prepared = self.prepared, None
        if prep is not None and prep.job.difference(job):
            prep = None
        if prep is not None and prep.tables is not None:
            tables = prep.tables
        else:
            tables = Tables.for_job(job, self.shard_id) if self.partition == 0 else Tables()
        self._buffer = prep.buffer if prep is not None else None
        cfg = modes.ModeConfig.from_job(job)
        start, end = partition_range(job.total_params, job.num_shards, job.partitions, self.shard_id, self.partition)
        self.job, self.tables, self._cfg, self.start, self.end = job, tables, cfg, start, end
        self.epochs = EpochBook(job.num_trainers, job.max_trainers, self.label)
        if job.total_params < job.num_shards:
            log.warning("shard %d: the job has fewer parameters (%d) than shards (%d)", self.shard_id,
                        job.total_params, job.num_shards)
        self._info("shard %d: job %s fixed: mode %s, %s, slice [%d, %d) of %d, optimizer %s lr %g",
                 self.shard_id, shorten(job.job_id or "(unnamed)"), job.mode, counted(job.num_trainers, "trainer"),
                 self.start, self.end, job.total_params, job.optimizer.name, job.optimizer.lr)

    def leave(self, rank: int, trainer_id: str, fingerprint: str) -> int:
        """``rank`` is done and forgotten; rounds stop waiting for it. Returns the live count left."""
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            # Out from the round after its last gradient: the open one if it is in it, else the open one
            at = self.version + 1 if rank in self.round.contributors else self.version
            epoch = self.epochs.leave(rank, at)
            if epoch is not None:
                self._epoch_changed(epoch, f"rank {rank} left")
            remaining = self.members.leave(rank)
            self._acked.pop(rank, None)
            self._holes.pop(rank, None)
            self._last_base.pop(rank, None)
            self.counters["leaves"] += 1
            self._info("shard %d: rank %d left; %d live", self.shard_id, rank, remaining)
            self._close_if_due()
            self.tables.close_due(self._table_members(), self._clock())
            self._changed()
            return remaining

    def _job_done(self) -> bool:
        """Every trainer of the job registered and all have left (said goodbye, not merely gone silent)."""
        if self.job is None or not self.started:
            return False
        view = self.members.view()
        return not view.live and view.registered <= view.left

    def job_done(self) -> bool:
        with self._lock:
            return self._job_done()

    def job_ended(self) -> bool:
        """``job_done`` without the lock, for a pre-check on the event loop (the membership has its own lock)."""
        return self._job_done()

    def check_member(self, rank: int, trainer_id: str, fingerprint: str, need_params: bool = False) -> None:
        """Refuse strangers and other jobs' trainers; renew the caller's lease.

        Safe on the event loop: only the membership's lock is taken.
        """
        job = self.job
        if job is None:
            raise NotReady(f"{self.label} has no job yet: register first")
        if fingerprint != job.fingerprint:
            raise JobMismatch(
                f"fingerprint is {shorten(fingerprint)} but the job's is {shorten(job.fingerprint)}: a different "
                "model or shard count"
            )
        if self.members.check(rank, trainer_id, self.shard_id):
            self.count("rejoins")
            log.info("shard %d: rank %d is heard from again after its lease expired: live again", self.shard_id, rank)
            self._changed()
        if need_params and self.params is None:
            raise NotReady(f"{self.label} is not initialised yet: rank 0 sends Init first")

    def is_member(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """Is the caller a registered trainer of the running job (its rank, trainer id and the job's
        fingerprint)?  A read: no lease is renewed, nothing is counted.  Safe on the event loop."""
        job = self.job
        return job is not None and fingerprint == job.fingerprint and self.members.holds(rank, trainer_id)

    def check_digest_caller(self, rank: int, trainer_id: str, fingerprint: str) -> None:
        """Refuse a state digest to all but the job's members: it is a pass over the whole state, tables
        included, so not work a stranger may ask for.  A read (no lease is renewed); with no job there is
        nothing to hash.  Safe on the event loop."""
        if self.job is None or self.is_member(rank, trainer_id, fingerprint):
            return
        raise NotPermitted(
            f"with_digest is set but rank {rank} as {shorten(trainer_id)} with fingerprint {shorten(fingerprint)} "
            f"is not a member of the job on {self.label}: a digest needs membership (rank, trainer_id and "
            "fingerprint of a registered trainer) or the shard's token")

    def heartbeat(self, rank: int, trainer_id: str, fingerprint: str) -> tuple[int, int]:
        """Renew ``rank``'s lease. Returns (version, live count). Safe on the event loop."""
        self.check_member(rank, trainer_id, fingerprint)
        return self.version, len(self.members.view().live)

    # ------------------------------------------------------------------ parameters
    def check_init_header(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """Refuse an Init on who sends it, before its payload is read. Returns False if already initialised."""
        self.check_member(rank, trainer_id, fingerprint)
        if rank != 0:
            raise JobMismatch(f"Init came from rank {rank}, but only rank 0 initialises the shards")
        return self.params is None

    def init(self, rank: int, trainer_id: str, fingerprint: str, values: torch.Tensor,
             take: bool = False) -> tuple[bool, int]:
        """Set the initial parameters; the first Init wins, later ones change nothing.

        ``take``: the caller hands ``values`` over (a freshly decoded fp32 tensor)
        and the shard keeps it instead of copying it.  The optimizer is built
        before anything is stored, so a failure leaves the shard uninitialised,
        not half-initialised.
        """
        with self._lock:
            self.check_init_header(rank, trainer_id, fingerprint)
            if values.numel() != self.end - self.start:
                raise InvalidRequest(f"length is {values.numel()} elements but this shard's slice has "
                                     f"{self.end - self.start}")
            if self.params is not None:
                return False, self.version
            owned = take and values.dtype == torch.float32 and values.is_contiguous()
            if self._buffer is not None and self._buffer.numel() == values.numel():
                data = self._buffer.copy_(values)  # the memory admitted at Register
            else:
                data = values if owned else values.float().clone()
            params = torch.nn.Parameter(data, requires_grad=False)
            optimizer = SliceOptimizer(self.job.optimizer, params)
            self.params, self.optimizer, self._buffer = params, optimizer, None
            self._info("shard %d: initialised by rank %d with %d parameters", self.shard_id, rank, values.numel())
            self._changed()
            return True, self.version

    def pull_ready(self, min_version: int) -> bool:
        """May a pull for ``min_version`` be answered now? (Lock-free: the server's wait predicate.)"""
        job = self.job
        return self._stopped or (
            job is not None and self.params is not None and self.version >= min_version
            and (job.mode == Mode.ASYNC or self.started)
        )

    def acquire_snapshot(self, rank: int, trainer_id: str, fingerprint: str, wire: int) -> tuple[int, torch.Tensor]:
        """(version, snapshot in the wire dtype) for a pull; hand it back with ``release_snapshot``.

        The snapshot is never written while a pull streams it: an fp32 pull streams
        the live parameters and a step that finds them streamed moves them first
        (in sync mode that is rare: every pull of a round ends before the next can
        close); a reduced-precision pull streams a copy converted once per version.
        """
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint, need_params=True)
            with self._snap_lock:
                snapshot = self.snapshots.acquire(self.params.detach(), self.version, TORCH_DTYPES[wire])
                self.counters["pulls"] += 1
                return self.version, snapshot

    def try_acquire_snapshot(self, wire: int) -> tuple[int, torch.Tensor] | None:
        """The fast path of ``acquire_snapshot`` for the event loop (caller checked membership): an fp32 pull
        when no step is writing the parameters and the lock is free at once; else None (use the worker)."""
        if TORCH_DTYPES[wire] != torch.float32 or not self._snap_lock.acquire(blocking=False):
            return None
        try:
            if self._stepping or self.params is None:
                return None
            snapshot = self.snapshots.acquire(self.params.detach(), self.version, torch.float32)
            self.counters["pulls"] += 1
            return self.version, snapshot
        finally:
            self._snap_lock.release()

    def release_snapshot(self, snapshot: torch.Tensor) -> None:
        """A pull finished (or abandoned) streaming ``snapshot``; its memory may be written again."""
        with self._snap_lock:
            self.snapshots.release(snapshot)

    def pull_wait_message(self, min_version: int, timeout: float) -> str:
        if self.params is None:
            return f"{self.label} was not initialised within {timeout:.1f} s: is rank 0 running?"
        if not self.started:
            missing = sorted(set(range(self.job.num_trainers)) - self.members.view().registered)
            named = ", ".join(map(str, missing[:MAX_MISSING_LISTED]))
            more = f" and {len(missing) - MAX_MISSING_LISTED} more" if len(missing) > MAX_MISSING_LISTED else ""
            return f"{self.label} still waits for ranks [{named}]{more} to register after {timeout:.1f} s"
        return f"{self.label} is at version {self.version}, not {min_version}, after {timeout:.1f} s"

    def check_push_header(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int) -> None:
        """Refuse a push on its header alone, before its payload is read (the caller checks dtype and size)."""
        self.check_member(rank, trainer_id, fingerprint, need_params=True)
        check_num_samples(num_samples)
        if base > self.version:
            raise FutureVersion(f"base version is {base} but {self.label} is at version {self.version}")
        book = self.epochs
        if self.job.max_trainers and rank not in book.members_at(base):
            self._check_in_an_epoch(rank, base)
            raise JobMismatch(f"base version is {base} but rank {rank} is a member of this job from round "
                              f"{min(e.round for e in book.timeline if rank in e.members and e.round > base)} "
                              "(its join): pull that version first")

    def _check_in_an_epoch(self, rank: int, base: int) -> None:
        """A joiner admitted but not committed (or one that never commits) is in no epoch: its gradients are
        no round's (they were summed into one); refused until its commit names its round."""
        if rank not in self.epochs.current.members:
            raise JobMismatch(f"rank {rank} is in no membership epoch of this job (base version is {base}): a "
                              "joiner pushes only after its commit (Register with join_round, docs/elastic.md)")

    def push(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int,
             grad: torch.Tensor, sequence: int = 0, finite: bool = True,
             leaving: bool = False) -> tuple[PushResult, torch.Tensor]:
        """Hand a validated gradient to the mode logic and carry out its decision (psserver.executor).

        Returns the result and the buffer the caller may reuse for its next
        receive: ``grad`` itself, or the round's previous sum when ``grad``'s
        memory became the new sum (see ``OpenRound.add``).

        A push whose (trainer id, sequence) was already acknowledged is a retry
        after a lost reply: it gets DUPLICATE, whatever the version is now
        (the round it was in may have closed since), and is not applied again.
        ``leaving``: the trainer's last gradient (``_leaving_with``).
        """
        with self._lock:
            self.check_push_header(rank, trainer_id, fingerprint, base, num_samples)
            if grad.numel() != self.end - self.start:
                raise InvalidRequest(f"length is {grad.numel()} elements but this shard's slice has "
                                     f"{self.end - self.start}")
            if sequence and check_sequence(self._acked, rank, trainer_id, sequence, holes=self._holes):
                self.counters["duplicates"] += 1
                log.info("shard %d: push #%d from rank %d was already acknowledged (%s); not applied again",
                         self.shard_id, sequence, rank, self._acked[rank][2].outcome)
                return PushResult("duplicate", self.version, 0), grad
            info = PushInfo(rank, base, num_samples, sequenced=bool(sequence), payload=grad)
            now = self._clock()
            d = modes.decide_push(self._cfg, self._view(), rank, base, now, finite=finite, sequenced=bool(sequence))
            if d.action is not modes.Action.DUPLICATE:
                self.metrics.staleness.observe(d.staleness)
            undo = self._leaving_with(rank, d) if leaving else None
            try:
                result, spare = execute(self, d, info, now)
            except BaseException:
                if undo is not None:
                    self.epochs.timeline = undo  # a refused push changes nothing
                raise
            if sequence:
                record_ack(self._acked, rank, trainer_id, sequence, result, holes=self._holes)
            return result, grad if spare is None else spare

    def _leaving_with(self, rank: int, d: modes.PushDecision) -> list | None:
        """A push announcing the trainer's leave (docs/elastic.md): the rank is out of the epoch from the round
        after this one.  Done before the push is carried out, so no reply of the next version -- the one this
        push may close the round into -- names the old epoch, and the others split that round's data without
        the leaver.  Returns the timeline before (to put back if the push is refused), or None if nothing
        changed (a duplicate, a dropped gradient, already out)."""
        if d.action not in (modes.Action.ACCUMULATE, modes.Action.APPLY, modes.Action.SKIP_IN_ROUND):
            return None
        before = list(self.epochs.timeline)
        epoch = self.epochs.leave(rank, self.version + 1)
        if epoch is None:
            return None
        self.counters["leaves_announced"] += 1
        self._epoch_changed(epoch, f"rank {rank} pushed its last gradient")
        return before

    # ---------------------------------------------------------- what the executor does to a dense slice
    _EVENT_COUNTERS = {"stale_dropped": "stale_dropped", "skipped": "nonfinite_skipped"}

    def count_event(self, event: str) -> None:
        self.counters[self._EVENT_COUNTERS[event]] += 1

    def future(self, base: int) -> Exception:
        return FutureVersion(f"base version is {base} but {self.label} is at version {self.version}")

    def stale(self, base: int, staleness: int) -> Exception:
        return StaleGradient(f"stale gradient: base version {base} is {staleness} behind version {self.version} of "
                             f"shard {self.shard_id}; dropped -- pull version {self.version} and go on",
                             self.version, staleness)

    def duplicate(self, push: PushInfo) -> None:
        self.counters["duplicates"] += 1
        log.info("shard %d: duplicate push from rank %d for base %d acknowledged, not applied",
                 self.shard_id, push.rank, push.base)

    def result(self, outcome: str, staleness: int, **extra) -> PushResult:
        return PushResult(outcome, self.version, staleness)

    def skipped(self, push: PushInfo) -> None:
        log.warning("shard %d: skipped a gradient with NaN/Inf values from rank %d (base %d)",
                    self.shard_id, push.rank, push.base)
        if not push.sequenced and self._cfg.mode == Mode.ASYNC:
            self._last_base[push.rank] = push.base

    def apply_now(self, push: PushInfo, staleness: int) -> PushResult:
        self._apply(push.payload)
        self._count_applied(push)
        self.counters["staleness_sum"] += staleness
        if not push.sequenced:
            self._last_base[push.rank] = push.base
        return self.result("applied", staleness)

    def accumulate(self, push: PushInfo, weight: float) -> torch.Tensor:
        try:
            spare = self.round.add(push.payload, weight)
        except InvalidRequest:
            self.counters["refused_overflow"] += 1
            raise
        self._count_applied(push)
        return spare

    def _count_applied(self, push: PushInfo) -> None:
        self.counters["pushes_applied"] += 1
        self.counters["samples"] += push.num_samples

    def scaled_in(self, push: PushInfo, factor: float) -> None:
        self.counters["stale_scaled"] += 1
        log.info("shard %d: scaled a stale gradient from rank %d by %.3f (staleness %d)",
                 self.shard_id, push.rank, factor, self.version - push.base)

    def round_changed(self) -> None:
        self._changed()

    # ------------------------------------------------------------------ rounds
    def tick(self) -> float | None:
        """Expire silent trainers' leases and close a round that is due; returns the next deadline (clock time)."""
        with self._lock:
            if self.job is None:
                return None
            for rank, pending in self.epochs.expire(self._clock()):
                self.counters["joins_abandoned"] += 1
                if self.members.holds(rank, pending.trainer_id):  # not a trainer that registered the rank since
                    self.members.leave(rank)
                log.warning("shard %d: %s asked to join as rank %d but did not commit within %.1f s: dropped",
                            self.shard_id, shorten(pending.trainer_id), rank, self.lease_timeout)
            gone = self.members.expire()
            for rank, silent in gone:
                self.counters["lease_expired"] += 1
                log.warning("shard %d: rank %d silent for %.1f s (lease %.1f s): dropped from the live set",
                            self.shard_id, rank, silent, self.lease_timeout)
            if self.params is not None:
                self._close_if_due()
            if self.tables.close_due(self._table_members(), self._clock()) or gone:
                self._changed()
            deadlines = [self.members.next_expiry(), self.epochs.next_deadline(),
                         *self.tables.deadlines(self._table_members())]
            if self.params is not None:
                deadlines.append(modes.round_deadline(self._cfg, self._view()))
            deadlines = [d for d in deadlines if d is not None]
            return min(deadlines) if deadlines else None

    def _close_if_due(self) -> None:
        reason = modes.decide_tick(self._cfg, self._view(), self._clock()) if self._cfg else None
        if reason is not None:
            self.close_round(reason)

    def close_round(self, reason: modes.CloseReason) -> None:
        """Average the open round (weighted by samples) and take one optimizer step -- or, when every
        gradient in it was skipped, advance the version without one, so its waiters go on."""
        n = len(self.round.contributors)
        missing = (sorted(self._view().live - self.round.contributors)
                   if reason is not modes.CloseReason.ALL_ARRIVED else [])
        average = self.round.average() if modes.round_takes_step(self.round.weight) else None
        # Reset before the step: a checkpoint the step takes must not hold this round as still open (a
        # --restore would apply it a second time).
        self.round.reset()
        if average is not None:
            self._apply(average)
        else:
            with self._snap_lock:
                self.version += 1
            self.counters["rounds_without_step"] += 1
        self.counters[f"rounds_{reason.value}"] += 1
        if reason is not modes.CloseReason.ALL_ARRIVED:
            log.info("shard %d: round %d closed by %s with %s; missing ranks %s",
                     self.shard_id, self.version - 1, reason.value, counted(n, "gradient"),
                     missing[:MAX_MISSING_LISTED])
        self._changed()

    def _apply(self, grad: torch.Tensor) -> None:
        """One optimizer step.  Copy on write: parameters a pull still streams are first moved to a spare
        buffer; while the step writes them, ``_stepping`` keeps the event loop's fast pulls away."""
        live = self.params.detach()
        with self._snap_lock:
            self._stepping = True
            spare = self.snapshots.spare(live, torch.float32) if self.snapshots.streaming(live) else None
        try:
            if spare is not None:
                spare.copy_(live)
                with self._snap_lock:
                    self.snapshots.keep(live)  # reusable once its pulls end
                self.params.data = spare  # the optimizer's state is keyed by the Parameter, not its memory
                self.optimizer.rebind()
                self.counters["params_moved_for_pulls"] += 1
            t0 = time.perf_counter()
            self._set_lr()
            self.optimizer.step(grad)
            elapsed = time.perf_counter() - t0
        finally:
            with self._snap_lock:
                self.version += 1
                self._stepping = False
        self.metrics.apply_seconds.observe(elapsed)
        self.counters["apply_seconds"] += elapsed
        self.counters["steps"] += 1
        if self._writer is not None and self.checkpointer.due(self.version):
            if self._writer.submit(self._capture()):
                self.counters["checkpoints_superseded"] += 1
        self._changed()

    def _set_lr(self) -> None:
        """The schedule's rate for the step about to be taken at ``self.version``: derived from the version
        alone, so a restored shard resumes the schedule and every trainer sees the same rate."""
        lr = lr_at(self.job.lr_schedule, self.job.optimizer.lr, self.version)
        lr *= lr_factor(self.job.lr_scaling, len(self.epochs.members_at(self.version)), self.job.num_trainers)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _changed(self) -> None:
        self._on_change(self)

    # ------------------------------------------------------------------ checkpoints
    def _capture(self) -> ShardState:
        """A copy of the resumable state, open round and acknowledgements included (a memory copy, no I/O)."""
        opt = self.optimizer.state_dict()
        opt_copy = {
            "state": {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                      for k, v in opt["state"].items()},
            "param_groups": [dict(g) for g in opt["param_groups"]],
        }
        open_round = self.round.to_checkpoint()
        acked = {r: (tid, seq, res.outcome, res.version, res.staleness) for r, (tid, seq, res) in self._acked.items()}
        return ShardState(self.shard_id, self.version, self.job, self.params.detach().clone(), opt_copy,
                          dict(self.counters), members=self.members.members(), acked=acked, open_round=open_round,
                          tables=self.tables.state(), partition=self.partition, epochs=self.epochs.state(),
                          holes={r: sorted(h) for r, h in self._holes.items()})

    def _checkpoint_written(self, ok: bool) -> None:
        self.count("checkpoints_written" if ok else "checkpoint_failures")

    def final_checkpoint(self) -> None:
        """On shutdown, after in-flight calls have drained: write the current state, open round included."""
        if self._writer is None:
            return
        with self._lock:
            state = self._capture() if self.params is not None else None
        self._writer.stop()
        if state is not None:
            self._writer.write_now(state)

    def restore(self) -> int | None:
        """Resume from the newest valid checkpoint; returns its version, or None if there is none."""
        state, skipped = self.checkpointer.load_latest()
        self.counters["checkpoints_skipped_damaged"] += len(skipped)
        if state is None:
            log.warning("shard %d: --restore found no valid checkpoint in %s; starting empty",
                        self.shard_id, self.checkpointer.directory)
            return None
        self.restore_state(state, str(self.checkpointer.directory), f"{counted(len(skipped), 'damaged file')} skipped")
        return state.version

    def restore_state(self, state: ShardState, source: str, note: str = "") -> None:
        """Take ``state`` as this shard's: a checkpoint of its own, or one re-cut from another shard count
        (psserver.reshard).  The checkpointer, if any, writes nothing older than it."""
        with self._lock:
            self._set_job(state.job)
            self.params = torch.nn.Parameter(state.params.clone(), requires_grad=False)
            self.optimizer = SliceOptimizer(self.job.optimizer, self.params)
            self.optimizer.load_state_dict(state.optimizer)
            self.version = state.version
            self.members.restore(state.members)
            self.epochs.restore(state.epochs)
            self.started = len(state.members) >= self.job.num_trainers
            self._acked = {r: (tid, seq, PushResult(outcome, version, staleness))
                           for r, (tid, seq, outcome, version, staleness) in state.acked.items()}
            self._holes = {r: frozenset(h) for r, h in state.holes.items()}
            self.round.restore(state.open_round, self._clock())
            self.tables.restore(state.tables, self._clock())
            self.counters.update({k: v for k, v in state.counters.items() if not k.startswith("checkpoints_")})
            self.counters["restored_version"] = state.version
            if self.checkpointer is not None:
                self.checkpointer.last_written = max(self.checkpointer.last_written, state.version - 1)
            log.warning("shard %d: restored version %d from %s (%s, %s, open round with %s)",
                        self.shard_id, state.version, source, note or "re-cut", counted(len(state.members), "member"),
                        counted(len(self.round.contributors), "gradient"))

    def _view(self) -> modes.RoundView:
        book, v = self.epochs, self.version
        held = book.held_from()
        return modes.RoundView(
            version=v,
            live=book.expected(self.members.view().live, v),  # the live members of this round's epoch
            held=held is not None and v >= held,
            members=len(book.members_at(v)),
            started=self.started,
            contributors=self.round.contributors,  # not copied: decisions only read them
            stale_in_round=self.round.stale,
            opened_at=self.round.opened_at,
            last_base=self._last_base,
        )

    # ------------------------------------------------------------------ sparse tables (psserver.sparse.serving)
    def _table_members(self) -> TableMembers:
        return TableMembers(frozenset(self.members.view().live), self.started)

    def pull_rows(self, rank: int, trainer_id: str, fingerprint: str, table: str,
                  ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(table version, rows of the unique ``ids``) for a member; rows met for the first time are created."""
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            result = self.tables.get(table).lookup(ids)
            self.counters["row_pulls"] += 1
            return result

    def push_rows(self, fingerprint: str, table: str, push: RowsPush, refuse_nonfinite: bool) -> RowsResult:
        """Hand one row push to its table (which checks, deduplicates and decides); wakes waiting pulls."""
        with self._lock:
            self.check_member(push.rank, push.trainer_id, fingerprint)
            result = self.tables.get(table).push(push, self._table_members(), self._clock(), refuse_nonfinite)
            self.counters["row_pushes"] += 1
            self._changed()
            return result

    # ------------------------------------------------------------------ stats
    def count(self, name: str, n: float = 1) -> None:
        self.counters[name] += n  # one dict update: atomic under the GIL

    def mode_config(self) -> modes.ModeConfig | None:
        return self._cfg

    def mode(self) -> str:
        job = self.job
        return job.mode if job else ""

    def wire_dtype(self) -> int:
        job = self.job
        return WIRE_DTYPES[job.wire_dtype] if job else 0

    def slice_length(self) -> int:
        return self.end - self.start

    def snapshot(self) -> StatsSnapshot:
        """Stats without the lock (see the module docstring): a scrape or GetStats never waits on a step."""
        job, tables = self.job, self.tables
        return StatsSnapshot(
            shard=self.shard_id, initialized=self.params is not None, version=self.version,
            mode=job.mode if job else "", start=self.start, end=self.end,
            live_ranks=sorted(self.members.view().live), counters={**self.counters, **tables.counters()}, job=job,
            lr=lr_at(job.lr_schedule, job.optimizer.lr, self.version) if job else 0.0, tables=tables.stats(),
        )

    def state_digest(self) -> str:
        """Hash of parameters, optimizer state, version, round buffers and membership epochs with pending joins
        (tests assert refusals leave it unchanged)."""
        with self._lock:
            r = self.round
            h = hashlib.sha256(f"v={self.version};acc_w={r.weight};c={sorted(r.contributors)}".encode())
            if self.params is not None:
                h.update(self.params.detach().numpy().tobytes())
                if r.weight:
                    h.update(r.sum.numpy().tobytes())
                for k, t in self.optimizer.state_items():
                    h.update(k.encode())
                    h.update(t.numpy().tobytes() if torch.is_tensor(t) else repr(t).encode())
            h.update(self.tables.digest())
            if self.epochs is not None:  # who rounds wait for is state too: a refused join must not change it
                h.update(self.epochs.digest_text().encode())
            return h.hexdigest()

    def stop(self) -> None:
        self._stopped = True
        self._changed()
