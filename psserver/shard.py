"""One shard's state: a slice of the parameters, its optimizer, its version, its job and members.

A shard owns a contiguous slice of the flat parameter vector, that slice's optimizer state, a version counter
(optimizer steps applied), the job spec, and the membership of trainers.  It knows nothing of the model's code,
nor of gRPC.  A push is decided by psserver.modes and carried out by psserver.executor.

``Shard`` is the lifecycle that holds one lock over its rooms, each made here at construction and handed what it
calls: who is in the job (``enrolment``, psserver.enrolment), the slice's memory, optimizer and version
(``slice``, psserver.dense_slice, one per job), what it remembers of each rank's pushes (``pushes``,
psserver.push_book), the executor's hooks (``hooks``, psserver.dense_hooks), and its checkpoints
(``checkpoints``, psserver.shard_checkpoints).  What stays here is what crosses them: the job, the round, the
tables, ticks, and capture/restore of the whole.

Why ``Shard`` is still ~550 lines: most of it is the public surface its callers (host, service, tests) call,
each a few lines that take the lock and hand on to a room (the job's data cursor, the elastic table checks and
the timeline's GetStats reply among the newest); the push path (header checks, dedupe, the leave announced
with a push) and the row calls are next to move into rooms of their own.

Threads: every method that touches tensors or the round is synchronous and is meant to run on the server's one
*state worker* thread (psserver.server), so they never contend; ``_lock`` still guards them for tests and the
checkpoint writer.  Nothing here waits: a pull that needs a newer version is waited for by the async server,
which ``on_change`` (a constructor argument) wakes.  Membership (leases, heartbeats) has its own lock
(psserver.membership) so the event loop can renew a lease without waiting behind a step.  Lock order: ``_lock``
then the membership's.

Reads that the event loop makes without ``_lock`` (``version``, ``params is None``, ``job``, ``snapshot()``) are
single attribute reads or C-level dict copies, atomic under the GIL; they may be a step behind, never torn.
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
from psserver.checkpoint import Checkpointer, ShardState
from psserver.common.logsafe import counted, shorten
from psserver.dense_hooks import DenseHooks
from psserver.data_cursor import DataCursor, Grant
from psserver.dense_slice import DenseSlice
from psserver.enrolment import MAX_MISSING_LISTED, Enrolment
from psserver.epochs import no_job_to_join
from psserver.executor import PushInfo, execute
from psserver.metrics import ShardMetrics
from psserver.protocol.epochs import lr_factor
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotReady
from psserver.protocol.job import WIRE_DTYPES, JobSpec
from psserver.protocol.layout import partition_range
from psserver.protocol.limits import check_num_samples
from psserver.protocol.rules import Mode
from psserver.protocol.schedules import lr_at
from psserver.push_book import PushBook, PushResult
from psserver.rounds import OpenRound
from psserver.shard_checkpoints import ShardCheckpoints
from psserver.sparse.serving import RowsPush, RowsResult, Tables
from psserver.stats import StatsSnapshot

__all__ = ["MAX_MISSING_LISTED", "Prepared", "PushResult", "Shard"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """What a job's first Register made for this partition before the job was recorded (psserver.host):
    its dense slice's memory, and on partition 0 its tables."""

    job: JobSpec
    buffer: torch.Tensor  # the slice's parameters, uninitialised: Init copies into it
    tables: Tables | None = None


class Shard:
    """State of shard ``shard_id``."""

    def __init__(self, shard_id: int, clock: Callable[[], float] = time.monotonic, lease_timeout: float = 5.0,
                 checkpointer: Checkpointer | None = None, partition: int = 0, metrics: ShardMetrics | None = None,
                 on_change: Callable[["Shard"], None] = lambda part: None, join_timeout: float = 0.0):
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
        self._on_change = on_change
        self._lock = threading.RLock()
        self.counters: Counter[str] = Counter()
        self.enrolment = Enrolment(shard_id, partition, self.label, clock, lease_timeout, self.counters,
                                   self._changed, join_timeout)
        self.members = self.enrolment.members
        self.metrics = metrics if metrics is not None else ShardMetrics(shard_id, self.snapshot)
        self.checkpoints = ShardCheckpoints(shard_id, checkpointer, self.counters)
        self._steps_in_push: list[int] | None = None  # versions a push's step made: checkpointed after its books
        self.hooks = DenseHooks(self, self._changed)
        self._stopped = False
        self.prepared: Prepared | None = None  # handed by the host when a job is admitted, taken by _set_job
        # (shard, round, average or None, lr or None) for each closed round: a live re-shard's forward log
        self.round_listener: Callable[..., None] | None = None  # (psserver.handoff_io)
        self._clear_job()

    def _clear_job(self) -> None:
        """No job: the state a shard starts in, and returns to when a job ended."""
        self.slice = DenseSlice(self.counters)  # first: lock-free readers test ``params`` before the job
        self.job: JobSpec | None = None
        self._cfg: modes.ModeConfig | None = None
        self.start = self.end = 0
        self.round = OpenRound()  # sync modes only
        self.pushes = PushBook()
        self.cursor = DataCursor(self.counters)  # async elastic data (psserver.data_cursor); shard 0 partition 0
        self.tables = Tables()  # sparse tables (psserver.sparse.serving): their own versions and rounds
        self.enrolment.reset()

    def free_job(self) -> int:
        """A live re-shard's RETIRE (psserver.layout_host): this tombstone's job state goes -- parameters, optimizer
        state, books, members -- its counters stay.  Returns the bytes of parameters and optimizer state freed."""
        with self._lock:
            freed = 0
            if self.params is not None:
                freed = self.params.numel() * self.params.element_size() + sum(
                    t.numel() * t.element_size() for _, t in self.optimizer.state_items() if torch.is_tensor(t))
            self._clear_job()
            return freed

    # the slice's and the enrolment's state, read where it was read before they had rooms of their own
    @property
    def params(self) -> torch.nn.Parameter | None:
        return self.slice.params

    @property
    def optimizer(self):
        return self.slice.optimizer

    @property
    def version(self) -> int:
        return self.slice.version

    @property
    def snapshots(self):
        return self.slice.snapshots

    @property
    def epochs(self):
        return self.enrolment.epochs

    @property
    def started(self) -> bool:
        return self.enrolment.started

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self.checkpoints.checkpointer

    def hold_prepared(self, prepared: Prepared) -> None:
        """The host admitted a job and made this partition's memory for it (``_set_job`` takes it)."""
        self.prepared = prepared

    # ------------------------------------------------------------------ membership and job
    def register(self, rank: int, trainer_id: str, expected_shard: int, job: JobSpec, join: bool = False,
                 join_round: int = 0, join_confirm: bool = False) -> dict:
        """Join ``rank`` to the job; the first registration fixes the job spec.

        A job whose every trainer registered and then left has ended: the next registration starts a new job
        from scratch (the shard does not carry the old weights into it).  A refused registration changes
        nothing.  ``join``: a trainer joining a running elastic job (``join_elastic``).
        """
        self.check_register(rank, expected_shard, job, join)
        if join:
            return self.join_elastic(rank, trainer_id, job, join_round, join_confirm)
        with self._lock:
            if self.job is not None and self._job_done():
                self._info("shard %d: job %s ended (every trainer left); %s starts a new job from scratch",
                           self.shard_id, shorten(self.job.job_id or "(unnamed)"), shorten(job.job_id or "(unnamed)"))
                self.counters["jobs_ended"] += 1
                self._clear_job()
            if self.job is None:
                self._set_job(job)
            else:
                self._check_same_job(job)
            replaced, registered, member_from = self.enrolment.register(rank, trainer_id, job, self.version)
            if replaced:
                self.pushes.new_process(rank)
            self._changed()
            return dict(
                shard=self.shard_id, start=self.start, end=self.end, initialized=self.params is not None,
                version=self.version, registered=registered, lease_seconds=self.lease_timeout,
                join_round=member_from,  # a rank that left, registered again: its first round (its table lanes')
            )

    def join_elastic(self, rank: int, trainer_id: str, job: JobSpec, join_round: int, confirm: bool = False) -> dict:
        """A join (docs/elastic.md): ``join_round`` 0 asks for admission -- a rank (partition 0 of shard 0 hands
        one out; elsewhere ``rank`` names it) and this shard's proposed round, holding later rounds until the
        join is settled; ``join_round`` E commits it from round E (holding round E - 1) and ``confirm`` ends the
        hold once every shard took the commit.  Refused, changing nothing, by the job
        (not elastic, full) or an E outside the window (psserver.protocol.epochs.commit_window)."""
        with self._lock:
            if self.job is None or self._job_done():
                raise no_job_to_join(self.label, ended=self.job is not None)
            self._check_same_job(job)
            rank, answer, replaced = self.enrolment.join(rank, trainer_id, join_round, self.version, confirm,
                                                         exact=self.job.mode == Mode.SYNC)
            if replaced:
                self.pushes.new_process(rank, holes=False)  # a new process on a rank that left
            self._close_if_due()
            self.tables.close_due(self.enrolment.table_members(), self._clock())  # a table round it held
            self._changed()
            view = self.members.view()
            return dict(shard=self.shard_id, start=self.start, end=self.end, initialized=self.params is not None,
                        version=self.version, registered=len(view.registered), lease_seconds=self.lease_timeout,
                        rank=rank, join_round=answer, membership_epoch=self.epochs.current.number)

    def _check_same_job(self, job: JobSpec) -> None:
        diff = self.job.difference(job)
        if diff:
            raise JobMismatch(f"job spec differs from the one this shard runs: {diff}")

    def epoch_timeline(self) -> list:
        return self.enrolment.timeline()

    def epoch_timeline_proto(self, members_from_round: int) -> list:
        return self.enrolment.timeline_proto(members_from_round)

    def epoch_number(self, version: int) -> int:
        """The membership epoch in effect at round ``version`` (what a pull of that version tells)."""
        return self.enrolment.epoch_number(version)

    def check_register(self, rank: int, expected_shard: int, job: JobSpec, join: bool = False) -> None:
        """Refuse a registration on what it says alone (psserver.enrolment), before anything of it is made."""
        self.enrolment.check_register(rank, expected_shard, job, join)

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
        dense = DenseSlice(self.counters, prep.buffer if prep is not None else None)
        cfg = modes.ModeConfig.from_job(job)
        start, end = partition_range(job.total_params, job.num_shards, job.partitions, self.shard_id, self.partition)
        self.slice, self.job, self.tables, self._cfg, self.start, self.end = dense, job, tables, cfg, start, end
        self.enrolment.start(job)
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
            remaining = self.enrolment.leave(rank, at)
            self.pushes.forget(rank)
            self.cursor.leave(rank)
            self._close_if_due()
            self.tables.close_due(self.enrolment.table_members(), self._clock())
            self._changed()
            return remaining

    def _job_done(self) -> bool:
        """Every trainer of the job registered and all have left (said goodbye, not merely gone silent)."""
        return self.enrolment.done(self.job)

    def job_done(self) -> bool:
        with self._lock:
            return self._job_done()

    def job_ended(self) -> bool:
        """``job_done`` without the lock, for a pre-check on the event loop (the membership has its own lock)."""
        return self._job_done()

    def check_member(self, rank: int, trainer_id: str, fingerprint: str, need_params: bool = False) -> None:
        """Refuse strangers and other jobs' trainers; renew the caller's lease.  Safe on the event loop."""
        self.enrolment.check_member(self.job, rank, trainer_id, fingerprint)
        if need_params and self.params is None:
            raise NotReady(f"{self.label} is not initialised yet: rank 0 sends Init first")

    def is_member(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """Is the caller a registered trainer of the running job?  A read.  Safe on the event loop."""
        return self.enrolment.is_member(self.job, rank, trainer_id, fingerprint)

    def check_digest_caller(self, rank: int, trainer_id: str, fingerprint: str) -> None:
        """Refuse a state digest to all but the job's members (psserver.enrolment).  Safe on the event loop."""
        self.enrolment.check_digest_caller(self.job, rank, trainer_id, fingerprint)

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
        """Set the initial parameters; the first Init wins, later ones change nothing.  ``take``: the caller
        hands ``values`` over (a freshly decoded fp32 tensor) and the shard keeps it instead of copying it."""
        with self._lock:
            self.check_init_header(rank, trainer_id, fingerprint)
            if values.numel() != self.end - self.start:
                raise InvalidRequest(f"length is {values.numel()} elements but this shard's slice has "
                                     f"{self.end - self.start}")
            if self.params is not None:
                return False, self.version
            self.slice.init(values, take, self.job.optimizer)
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

        The snapshot is never written while a pull streams it: an fp32 pull streams the live parameters and a
        step that finds them streamed moves them first (in sync mode that is rare: every pull of a round ends
        before the next can close); a reduced-precision pull streams a copy converted once per version.
        """
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint, need_params=True)
            return self.slice.acquire(wire)

    def try_acquire_snapshot(self, wire: int) -> tuple[int, torch.Tensor] | None:
        """The fast path of ``acquire_snapshot`` for the event loop (caller checked membership); None: use the
        worker (psserver.dense_slice)."""
        return self.slice.try_acquire(wire)

    def release_snapshot(self, snapshot: torch.Tensor) -> None:
        """A pull finished (or abandoned) streaming ``snapshot``; its memory may be written again."""
        self.slice.release(snapshot)

    def pull_wait_message(self, min_version: int, timeout: float) -> str:
        if self.params is None:
            return f"{self.label} was not initialised within {timeout:.1f} s: is rank 0 running?"
        if not self.started:
            missing = self.enrolment.missing_registrations(self.job.num_trainers)
            return f"{self.label} still waits for ranks {missing} to register after {timeout:.1f} s"
        return f"{self.label} is at version {self.version}, not {min_version}, after {timeout:.1f} s"

    def check_push_header(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int) -> None:
        """Refuse a push on its header alone, before its payload is read (the caller checks dtype and size)."""
        self.check_member(rank, trainer_id, fingerprint, need_params=True)
        check_num_samples(num_samples)
        if base > self.version:
            raise self.hooks.future(base)
        self.enrolment.check_base(self.job, rank, base)

    def push(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int,
             grad: torch.Tensor, sequence: int = 0, finite: bool = True,
             leaving: bool = False, claim: tuple[int, int] | None = None) -> tuple[PushResult, torch.Tensor]:
        """Hand a validated gradient to the mode logic and carry out its decision (psserver.executor).

        Returns the result and the buffer the caller may reuse for its next receive: ``grad`` itself, or the
        round's previous sum when ``grad``'s memory became the new sum (see ``OpenRound.add``).

        A push whose (trainer id, sequence) was already acknowledged is a retry after a lost reply: it gets
        DUPLICATE, whatever the version is now (the round it was in may have closed since), and is not applied
        again.  ``leaving``: the trainer's last gradient (``_leaving_with``).  ``claim``: (claim number, batches
        per epoch) of the trainer's next batch, granted by the data cursor once this gradient is taken (read it
        from ``cursor.claims[rank]``); one the cursor would refuse is left out, not the push refused
        (``_claim_offer``).
        """
        with self._lock:
            self.check_push_header(rank, trainer_id, fingerprint, base, num_samples)
            claim = self._claim_offer(rank, trainer_id, claim)
            if grad.numel() != self.end - self.start:
                raise InvalidRequest(f"length is {grad.numel()} elements but this shard's slice has "
                                     f"{self.end - self.start}")
            if sequence and self.pushes.is_duplicate(rank, trainer_id, sequence):
                self.counters["duplicates"] += 1
                log.info("shard %d: push #%d from rank %d was already acknowledged (%s); not applied again",
                         self.shard_id, sequence, rank, self.pushes.outcome(rank))
                if claim is not None:
                    self.cursor.claim(rank, trainer_id, *claim)  # a retried claim: the same batch
                return PushResult("duplicate", self.version, 0), grad
            info = PushInfo(rank, base, num_samples, sequenced=bool(sequence), payload=grad)
            now = self._clock()
            d = modes.decide_push(self._cfg, self._view(), rank, base, now, finite=finite, sequenced=bool(sequence))
            if d.action is not modes.Action.DUPLICATE:
                self.metrics.staleness.observe(d.staleness)
            undo = self._leaving_with(rank, d) if leaving else None
            self._steps_in_push = []
            try:
                result, spare = execute(self.hooks, d, info, now)
            except BaseException:
                if undo is not None:
                    self.enrolment.put_back(undo)  # a refused push changes nothing
                self._checkpoint_steps_in_push()
                raise
            if sequence:
                self.pushes.record(rank, trainer_id, sequence, result)
            if claim is not None:
                self.cursor.claim(rank, trainer_id, *claim)
            self._checkpoint_steps_in_push()
            return result, grad if spare is None else spare

    def _checkpoint_steps_in_push(self) -> None:
        """A checkpoint due at a version this push's step made, taken once the push's acknowledgement and claim
        are booked: restored, that version is the state after the push (its retry DUPLICATE, its grant kept)."""
        due, self._steps_in_push = self._steps_in_push or [], None
        for version in due:
            self.checkpoints.after_step(version, self.capture)

    def claim_batch(self, rank: int, trainer_id: str, fingerprint: str, number: int, per_epoch: int,
                    release: bool = False) -> Grant:
        """The job's data cursor (psserver.data_cursor): grant a member its next batch, async and stale-timeout
        only, here on shard 0 partition 0 only (the one cursor of the job)."""
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            self._check_claim(rank, trainer_id, number, per_epoch)
            return self.cursor.claim(rank, trainer_id, number, per_epoch, release)

    def _claim_offer(self, rank: int, trainer_id: str, claim: tuple[int, int] | None) -> tuple[int, int] | None:
        """A push's claim, or None if the cursor would refuse it: a push is never refused for its claim (a
        windowed push sent again after the trainer claimed on may carry an old number); the trainer asks with
        ClaimBatch instead, which refuses it properly.  Counted in ``push_claims_ignored``."""
        if claim is None:
            return None
        try:
            self._check_claim(rank, trainer_id, *claim)
        except (JobMismatch, InvalidRequest) as e:
            self.counters["push_claims_ignored"] += 1
            log.debug("shard %d: rank %d's push claims a batch that is not granted: %s", self.shard_id, rank, e)
            return None
        return claim

    def _check_claim(self, rank: int, trainer_id: str, number: int, per_epoch: int) -> None:
        if self.shard_id != 0 or self.partition != 0:
            raise JobMismatch(f"claim is {number} but this is {self.label}: claims go to shard 0 partition 0 (the "
                              "job's one data cursor)")
        if self.job.mode == Mode.SYNC:
            raise JobMismatch(f"claim is {number} but mode is {self.job.mode}: a sync round's batch is placed by "
                              "the membership timeline (trainer.data.round_batch), not claimed")
        self.cursor.check(rank, trainer_id, number, per_epoch)

    def _leaving_with(self, rank: int, d: modes.PushDecision) -> list | None:
        """A push announcing the trainer's leave (docs/elastic.md): the rank is out of the epoch from the round
        after this one.  Done before the push is carried out, so no reply of the next version -- the one this
        push may close the round into -- names the old epoch, and the others split that round's data without
        the leaver.  Returns the timeline before (to put back if the push is refused), or None if nothing
        changed (a duplicate, a dropped gradient, already out)."""
        if d.action not in (modes.Action.ACCUMULATE, modes.Action.APPLY, modes.Action.SKIP_IN_ROUND):
            return None
        return self.enrolment.leaving_with(rank, self.version)

    # ------------------------------------------------------------------ rounds
    def tick(self) -> float | None:
        """Expire silent trainers' leases and close a round that is due; returns the next deadline (clock time)."""
        with self._lock:
            if self.job is None:
                return None
            gone = self.enrolment.expire()
            if self.params is not None:
                self._close_if_due()
            if self.tables.close_due(self.enrolment.table_members(), self._clock()) or gone:
                self._changed()
            deadlines = [*self.enrolment.deadlines(), *self.tables.deadlines(self.enrolment.table_members())]
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
        lr = self._lr() if average is not None and self.round_listener is not None else None
        if average is not None:
            self.apply_step(average)
        else:
            self.slice.advance()
            self.counters["rounds_without_step"] += 1
        if self.round_listener is not None:  # after the step: a range copied again is at the new version
            self.round_listener(self, self.version - 1, average, lr)
        self.counters[f"rounds_{reason.value}"] += 1
        if reason is not modes.CloseReason.ALL_ARRIVED:
            log.info("shard %d: round %d closed by %s with %s; missing ranks %s",
                     self.shard_id, self.version - 1, reason.value, counted(n, "gradient"),
                     missing[:MAX_MISSING_LISTED])
        self._changed()

    def apply_step(self, grad: torch.Tensor) -> None:
        """One optimizer step at the schedule's rate (psserver.dense_slice), then a checkpoint if one is due."""
        elapsed = self.slice.step(grad, self._lr())
        self.metrics.apply_seconds.observe(elapsed)
        self.counters["apply_seconds"] += elapsed
        self.counters["steps"] += 1
        if self._steps_in_push is not None:
            self._steps_in_push.append(self.version)  # push() takes it after its books (_checkpoint_steps_in_push)
        else:
            self.checkpoints.after_step(self.version, self.capture)
        self._changed()

    def _lr(self) -> float:
        """The schedule's rate for the step about to be taken at ``self.version``: derived from the version
        alone, so a restored shard resumes the schedule and every trainer sees the same rate."""
        lr = lr_at(self.job.lr_schedule, self.job.optimizer.lr, self.version)
        return lr * lr_factor(self.job.lr_scaling, self.enrolment.members_at(self.version), self.job.num_trainers)

    def _changed(self) -> None:
        self._on_change(self)

    def _view(self) -> modes.RoundView:
        return self.enrolment.round_view(self.version, self.round, self.pushes.last_base)

    # ------------------------------------------------------------------ checkpoints
    def capture(self) -> ShardState:
        """A copy of the resumable state, open round and acknowledgements included (a memory copy, no I/O)."""
        params, opt_copy = self.slice.capture()
        acked, holes = self.pushes.state()
        return ShardState(self.shard_id, self.version, self.job, params, opt_copy,
                          dict(self.counters), members=self.members.members(), acked=acked,
                          open_round=self.round.to_checkpoint(), tables=self.tables.state(), partition=self.partition,
                          epochs=self.epochs.state(), holes=holes, cursor=self.cursor.state())

    def final_checkpoint(self) -> None:
        """On shutdown, after in-flight calls have drained: write the current state, open round included."""
        if not self.checkpoints.enabled:
            return
        with self._lock:
            state = self.capture() if self.params is not None else None
        self.checkpoints.final(state)

    def restore(self) -> int | None:
        """Resume from the newest valid checkpoint; returns its version, or None if there is none."""
        state, note = self.checkpoints.load_latest()
        if state is None:
            return None
        self.restore_state(state, str(self.checkpointer.directory), note)
        return state.version

    def restore_state(self, state: ShardState, source: str, note: str = "") -> None:
        """Take ``state`` as this shard's: a checkpoint of its own, or one re-cut from another shard count
        (psserver.reshard).  The checkpointer, if any, writes nothing older than it."""
        with self._lock:
            self._set_job(state.job)
            self.slice.restore(state.params, state.optimizer, state.version, self.job.optimizer)
            self.enrolment.restore(state.members, state.epochs, self.job.num_trainers)
            self.pushes.restore(state.acked, state.holes)
            self.cursor.restore(state.cursor)
            self.round.restore(state.open_round, self._clock())
            self.tables.restore(state.tables, self._clock())
            self.counters.update({k: v for k, v in state.counters.items() if not k.startswith("checkpoints_")})
            self.counters["restored_version"] = state.version
            self.checkpoints.restored(state.version)
            log.warning("shard %d: restored version %d from %s (%s, %s, open round with %s)",
                        self.shard_id, state.version, source, note or "re-cut", counted(len(state.members), "member"),
                        counted(len(self.round.contributors), "gradient"))

    # ------------------------------------------------------------------ sparse tables (psserver.sparse.serving)
    def check_row_pull(self, rank: int, min_version: int) -> None:
        """Refuse a PullRows from a joiner not yet committed (psserver.enrolment); safe on the event loop."""
        self.enrolment.check_row_pull(self.job, rank, min_version)

    def pull_rows(self, rank: int, trainer_id: str, fingerprint: str, table: str,
                  ids: torch.Tensor, min_version: int = 0) -> tuple[int, torch.Tensor]:
        """(table version, rows of the unique ``ids``) for a member; rows met for the first time are created."""
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            self.enrolment.check_row_pull(self.job, rank, min_version)
            result = self.tables.get(table).lookup(ids)
            self.counters["row_pulls"] += 1
            return result

    def push_rows(self, fingerprint: str, table: str, push: RowsPush, refuse_nonfinite: bool,
                  checked=None) -> RowsResult:
        """Hand one row push to its table (which checks, deduplicates and decides); wakes waiting pulls.
        ``checked``: the push's ids as the table checked them already (a Step's part: CheckedIds)."""
        with self._lock:
            self.check_member(push.rank, push.trainer_id, fingerprint)
            served = self.tables.get(table)
            self.enrolment.check_table_base(self.job, push.rank, push.base, served.mode)
            result = served.push(push, self.enrolment.table_members(), self._clock(), refuse_nonfinite, checked)
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
            # who rounds wait for is state too: a refused join must not change it
            h.update(self.enrolment.digest_text().encode())
            h.update(self.cursor.digest_text().encode())
            return h.hexdigest()

    def stop(self) -> None:
        self._stopped = True
        self._changed()
