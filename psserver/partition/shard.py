"""One shard's state: a slice of the parameters, its optimizer, its version, its job and members.

A shard owns a contiguous slice of the flat parameter vector, that slice's optimizer state, a version counter
(optimizer steps applied), the job spec, and the membership of trainers.  It knows nothing of the model's code,
nor of gRPC.  A push is decided by psserver.state.modes and carried out by psserver.state.executor.

``Shard`` is the lifecycle that holds one lock over its rooms, each made here at construction and handed what it
calls: who is in the job (``enrolment``, psserver.members.enrolment), the slice's memory, optimizer and version
(``slice``, psserver.state.dense_slice, one per job), what it remembers of each rank's pushes (``pushes``,
psserver.state.push_book), the executor's hooks (``hooks``, psserver.state.dense_hooks), and its checkpoints
(``checkpoints``, psserver.partition.shard_checkpoints).  What stays here is what crosses them: the job, clearing and
fixing it, capture/restore of the whole, and the one-line reads of the job (its mode, wire dtype, counters).

Its calls are in rooms by family, one module each, each room made here with the lock and what else it calls:
register, join, leave and the member checks (``admission``, psserver.partition.shard_members), Init and pulls
(``pulls``, psserver.partition.shard_pulls), a dense push and the claim it carries (``dense_pushes``,
psserver.partition.shard_pushes), ticks and closing a round (``rounds``, psserver.partition.shard_rounds), the row calls
(``rows``, psserver.partition.shard_rows), and the stats snapshot and state digest (``stats``,
psserver.partition.shard_stats).  A room holds no state of the job: what a job's life replaces (the job, its slice,
round, books, cursor, tables) is the shard's, and a room reads it through the shard at each call.  The calls most
made -- the servicer's and the host's on the hot path, and the tests' -- are also ``Shard``'s own, one line each
handing on to their room; the rest are called on the room (``shard.pulls.acquire_snapshot``).

Threads: every method that touches tensors or the round is synchronous and is meant to run on the server's one
*state worker* thread (psserver.serving.server), so they never contend; ``_lock`` still guards them for tests and the
checkpoint writer.  Nothing here waits: a pull that needs a newer version is waited for by the async server,
which ``on_change`` (a constructor argument) wakes.  Membership (leases, heartbeats) has its own lock
(psserver.members.membership) so the event loop can renew a lease without waiting behind a step.  Lock order: ``_lock``
then the membership's.

Reads that the event loop makes without ``_lock`` (``version``, ``params is None``, ``job``, ``snapshot()``) are
single attribute reads or C-level dict copies, atomic under the GIL; they may be a step behind, never torn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import torch

from psserver.common.logsafe import counted, shorten
from psserver.members.data_cursor import DataCursor
from psserver.members.enrolment import MAX_MISSING_LISTED, Enrolment
from psserver.partition.shard_checkpoints import ShardCheckpoints
from psserver.partition.shard_members import Admission
from psserver.partition.shard_pulls import Pulls
from psserver.partition.shard_pushes import DensePushes
from psserver.partition.shard_rounds import Rounds
from psserver.partition.shard_rows import RowCalls
from psserver.partition.shard_stats import Stats
from psserver.protocol.job import WIRE_DTYPES, JobSpec
from psserver.protocol.layout import partition_range
from psserver.sparse.serving import RowsPush, RowsResult, Tables
from psserver.state import modes
from psserver.state.checkpoint import Checkpointer, ShardState
from psserver.state.dense_hooks import DenseHooks
from psserver.state.dense_slice import DenseSlice
from psserver.state.metrics import ShardMetrics
from psserver.state.push_book import PushBook, PushResult
from psserver.state.rounds import OpenRound
from psserver.state.stats import StatsSnapshot

__all__ = ["MAX_MISSING_LISTED", "Prepared", "PushResult", "Shard"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """What a job's first Register made for this partition before the job was recorded (psserver.partition.host):
    its dense slice's memory, and on partition 0 its tables."""

    job: JobSpec
    buffer: torch.Tensor  # the slice's parameters, uninitialised: Init copies into it
    tables: Tables | None = None


class Shard:
    """State of shard ``shard_id``: its lifecycle here, its calls in the rooms it makes (the module docstring)."""

    def __init__(self, shard_id: int, clock: Callable[[], float] = time.monotonic, lease_timeout: float = 5.0,
                 checkpointer: Checkpointer | None = None, partition: int = 0, metrics: ShardMetrics | None = None,
                 on_change: Callable[["Shard"], None] = lambda part: None, join_timeout: float = 0.0):
        """``metrics``: the registry this shard observes into (its host's, shared by every partition; a shard of
        its own makes one over its own snapshot).  ``on_change(shard)``: called on every change of the state a
        waiting pull or the round timer may be waiting for, from the thread that made it (the server wakes its
        waiters with it, psserver.serving.runtime.Wakeups)."""
        self.shard_id = shard_id
        # Partition k > 0 of a partitioned job (psserver.partition.host) is a Shard of its own for the range of its piece;
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
        lock, changed = self._lock, self._changed
        self.rounds = Rounds(self, lock, clock, changed)
        self.hooks = DenseHooks(self, self.rounds, changed)
        self.admission = Admission(self, lock, clock, changed, self._info, self.rounds, self._set_job, self._clear_job)
        self.pulls = Pulls(self, lock, changed, self._info, self.admission)
        self.dense_pushes = DensePushes(self, lock, clock, self.admission, self.rounds, self.hooks)
        self.rows = RowCalls(self, lock, clock, changed, self.admission)
        self.stats = Stats(self, lock)
        self.prepared: Prepared | None = None  # handed by the host when a job is admitted, taken by _set_job
        # (shard, round, average or None, lr or None) for each closed round: a live re-shard's forward log
        self.round_listener: Callable[..., None] | None = None  # (psserver.resharding.handoff.shard_ops)
        # a live re-shard's (shard, base) -> the refusal of a new push, or None (psserver.resharding.handoff.shard_async)
        self.push_gate: Callable[..., Exception | None] | None = None
        self.job_changes = 0  # jobs set and cleared: what a read shows belongs to another job after each
        self._clear_job()

    def _clear_job(self) -> None:
        """No job: the state a shard starts in, and returns to when a job ended."""
        self.job_changes += 1  # (``exposed``)
        self.slice = DenseSlice(self.counters)  # first: lock-free readers test ``params`` before the job
        self.job: JobSpec | None = None
        self._cfg: modes.ModeConfig | None = None
        self.start = self.end = 0
        self.round = OpenRound()  # sync modes only
        self.pushes = PushBook()
        self.cursor = DataCursor(self.counters)  # async elastic data (psserver.members.data_cursor); shard 0 partition 0
        self.tables = Tables()  # sparse tables (psserver.sparse.serving): their own versions and rounds
        self.enrolment.reset()

    def free_job(self) -> int:
        """A live re-shard's RETIRE (psserver.resharding.layout_host): this tombstone's job state goes -- parameters, optimizer
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

    # ------------------------------------------------------------------ the job
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
        self.job_changes += 1
        self.enrolment.start(job)
        if job.total_params < job.num_shards:
            log.warning("shard %d: the job has fewer parameters (%d) than shards (%d)", self.shard_id,
                        job.total_params, job.num_shards)
        self._info("shard %d: job %s fixed: mode %s, %s, slice [%d, %d) of %d, optimizer %s lr %g",
                   self.shard_id, shorten(job.job_id or "(unnamed)"), job.mode, counted(job.num_trainers, "trainer"),
                   self.start, self.end, job.total_params, job.optimizer.name, job.optimizer.lr)

    def _changed(self) -> None:
        self._on_change(self)

    # ------------------------------------------------------------------ checkpoints
    def capture(self, since: dict | None = None, dense: bool = True) -> ShardState:
        """A copy of the resumable state, open round and acknowledgements included (a memory copy, no I/O).
        ``since``: table name -> a mark taken earlier: those tables' rows touched after it only (ServedTables.state);
        ``dense`` False: without the slice and its optimizer state (a hot standby's shipment of its steps)."""
        params, opt_copy = self.slice.capture() if dense else (None, None)
        acked, holes = self.pushes.state()
        return ShardState(self.shard_id, self.version, self.job, params, opt_copy,
                          dict(self.counters), members=self.members.members(), acked=acked,
                          open_round=self.round.to_checkpoint(), tables=self.tables.state(since), partition=self.partition,
                          epochs=self.epochs.state(), holes=holes, cursor=self.cursor.state())

    def exposed(self) -> tuple:
        """Counters that move whenever what a read of this partition shows changes: its job (set or cleared), its
        dense slice (initialised, version), its members and epochs, and its tables' (ServedTable.exposed).
        Monotone: a read after a change never finds the counters a capture took before it
        (psserver.replication.shipper)."""
        epochs = self.epochs  # (None before a job)
        return (self.job_changes, self.slice.params is not None, self.slice.version, self.members.changes,
                epochs.changes if epochs is not None else 0, self.tables.exposed())

    def state_since(self, since: dict | None) -> tuple[ShardState | None, dict]:
        """A hot standby's next shipment and the marks the one after builds on, at one moment (the shard's lock):
        ``capture`` with, after the marks ``since`` an earlier call returned, only the table rows touched since
        and the dense steps taken since (``dense_steps``) where the slice's log holds them all, else the slice
        whole (None: everything whole).  None before a job with parameters is registered."""
        with self._lock:
            if self.params is None:
                return None, {}
            steps = self.slice.take_steps(since["dense"] if since else -1)  # (the log starts again from now)
            state = self.capture(since["tables"] if since else None, dense=steps is None)
            if steps is not None:
                state = replace(state, dense_steps={"since": since["dense"], "steps": steps})
            return state, {"tables": self.tables.marks(), "dense": self.version}

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

    def restore_state(self, state: ShardState, source: str, note: str = "", planned: bool = False) -> None:
        """Take ``state`` as this shard's: a checkpoint of its own, or one re-cut from another shard count
        (psserver.resharding.reshard).  The checkpointer, if any, writes nothing older than it.  ``planned``: a
        live re-shard's switch, logged as the normal event it is (a restore after a crash is a warning)."""
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
            log.log(logging.INFO if planned else logging.WARNING,
                    "shard %d: restored version %d from %s (%s, %s, open round with %s)",
                    self.shard_id, state.version, source, note or "re-cut", counted(len(state.members), "member"),
                    counted(len(self.round.contributors), "gradient"))

    @property
    def lock(self):
        """The lock every call on this partition holds (a live re-shard snapshots its tables under it)."""
        return self._lock

    def stop(self) -> None:
        self.pulls.stop()
        self._changed()

    # ------------------------------------------------------------------ the job's one-line reads
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

    # ------------------------------------------------------------------ the calls most made, each in its room
    def register(self, rank: int, trainer_id: str, expected_shard: int, job: JobSpec, join: bool = False,
                 join_round: int = 0, join_confirm: bool = False, peer: str = "") -> dict:
        return self.admission.register(rank, trainer_id, expected_shard, job, join, join_round, join_confirm, peer)

    def check_member(self, rank: int, trainer_id: str, fingerprint: str, need_params: bool = False) -> None:
        self.admission.check_member(rank, trainer_id, fingerprint, need_params)

    def heartbeat(self, rank: int, trainer_id: str, fingerprint: str) -> tuple[int, int]:
        return self.admission.heartbeat(rank, trainer_id, fingerprint)

    def leave(self, rank: int, trainer_id: str, fingerprint: str) -> int:
        return self.admission.leave(rank, trainer_id, fingerprint)

    def init(self, rank: int, trainer_id: str, fingerprint: str, values: torch.Tensor,
             take: bool = False) -> tuple[bool, int]:
        return self.pulls.init(rank, trainer_id, fingerprint, values, take)

    def push(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int,
             grad: torch.Tensor, sequence: int = 0, finite: bool = True,
             leaving: bool = False, claim: tuple[int, int] | None = None) -> tuple[PushResult, torch.Tensor]:
        return self.dense_pushes.push(rank, trainer_id, fingerprint, base, num_samples, grad, sequence, finite,
                                      leaving, claim)

    def tick(self) -> float | None:
        return self.rounds.tick()

    def pull_rows(self, rank: int, trainer_id: str, fingerprint: str, table: str,
                  ids: torch.Tensor, min_version: int = 0) -> tuple[int, torch.Tensor]:
        return self.rows.pull_rows(rank, trainer_id, fingerprint, table, ids, min_version)

    def check_row_push_lands(self, table: str, push: RowsPush) -> None:
        self.rows.check_row_push_lands(table, push)

    def push_rows(self, fingerprint: str, table: str, push: RowsPush, refuse_nonfinite: bool,
                  checked=None) -> RowsResult:
        return self.rows.push_rows(fingerprint, table, push, refuse_nonfinite, checked)

    def checkpoints_after_trip(self):
        """A Step's trip: the checkpoints its dense push makes due wait for its table pushes (ShardCheckpoints)."""
        return self.checkpoints.after_trip(self.capture)

    def snapshot(self) -> StatsSnapshot:
        return self.stats.snapshot()

    def state_digest(self) -> str:
        return self.stats.state_digest()
