"""The partitions one ps-server process serves (BytePS's lesson: rounds per piece, not per slice).

A job may cut each shard's slice into ``JobSpec.partitions`` pieces
(psserver.protocol.layout.partition_range).  Each piece is served by a ``Shard`` of its
own -- membership, round, version, optimizer step over its range, sequence
numbers, checkpoints -- so a trainer pushes a piece as soon as backward has
produced it and pulls it as soon as its round closes, while other pieces are
still in flight.  Element-wise optimizers make a step per piece the same step
as one over the slice, so sync mode stays bit-identical to an unpartitioned job.

Reusing ``Shard`` whole keeps one implementation of everything that must be
exact (rounds, exactly-once pushes, checkpoints, refusals); the price is a
membership per partition, which trainers renew with every call they make to it.

Partition 0 exists from the start (it also restores and holds the sparse
tables); the others are created when a job with more partitions registers, and
restored from their own checkpoint folders (``DIR/partition-K``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from psserver.common.logsafe import shorten
from psserver.members.epochs import no_job_to_join
from psserver.partition.shard import Prepared, Shard
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotReady, OutOfMemory, PsError, is_out_of_memory
from psserver.protocol.job import JobSpec
from psserver.protocol.layout import partition_range
from psserver.protocol.limits import MAX_PARTITIONS
from psserver.sparse.serving import Tables
from psserver.state.budget import MemoryBudget, Plan
from psserver.state.checkpoint import Checkpointer
from psserver.state.metrics import ShardMetrics
from psserver.state.stats import StatsSnapshot, WideCounts

log = logging.getLogger(__name__)

# Counters that hold a state, not a count: each partition reports its own, never a sum over partitions.
OWN_VALUES = ("restored_version",)  # the version its checkpoint brought back (Shard.restore)


def allocate_slice(elements: int) -> torch.Tensor:
    """A partition's parameter memory, uninitialised (Init fills it): made at Register, so a slice the machine
    cannot give fails there, as RESOURCE_EXHAUSTED, not half-way through a job.  A function of its own so a test
    can make it fail."""
    return torch.empty(elements, dtype=torch.float32)


class ShardHost:
    """Partition 0 and the partitions a job added; routes calls by partition index."""

    def __init__(self, shard_id: int, clock: Callable[[], float] = time.monotonic, lease_timeout: float = 5.0,
                 checkpoint_dir: str = "", checkpoint_every: int = 100,
                 on_change: Callable[[Shard], None] = lambda part: None, budget: MemoryBudget | None = None,
                 gauges: Callable[[], dict] = dict, join_timeout: float = 0.0, layout: int = 0,
                 wide: WideCounts | None = None, metrics: ShardMetrics | None = None):
        """``on_change(part)``: handed to every partition this host makes (see ``Shard``); the server's
        wake-up for the calls waiting on ``part``.  The metrics registry is made here, over ``snapshot``:
        it counts every partition.  ``budget``: what a job may hold here (``--max-memory``; psserver.state.budget).
        ``gauges()``: the serving process's own numbers now (the loop's stall, connections, bytes of unread
        replies), shown with the counters.  ``layout``: the layout epoch this host serves (its checkpoints'
        names say it: psserver.state.checkpoint.file_name).  ``wide`` and ``metrics``: the process's shard-wide counters
        and metrics registry, which a later layout's host shares (``successor``) so they survive a switch."""
        self.shard_id, self.clock, self.lease_timeout, self.layout = shard_id, clock, lease_timeout, layout
        self.join_timeout = join_timeout  # a pending join's hold; 0: the default (psserver.members.epochs.join_patience)
        self.budget = budget if budget is not None else MemoryBudget()
        self.plan: Plan | None = None  # the running (or admitted) job's: the bytes it reserved
        self._gauges = gauges
        self._checkpoint_dir, self._checkpoint_every = checkpoint_dir, checkpoint_every
        self._on_change = on_change
        self.wide = wide if wide is not None else WideCounts()  # refusals, bytes, calls: every layout's (stats.py)
        self.metrics = metrics if metrics is not None else ShardMetrics(shard_id, self.snapshot)
        self.parts: list[Shard] = [self._fresh(0)]

    def successor(self, shard_id: int, layout: int | None = None) -> "ShardHost":
        """An empty host for layout epoch ``layout`` (default: the one after this host's; psserver.resharding.layout_host),
        where this process is shard ``shard_id``: the same clock, leases, budget, gauges, wake-ups and checkpoint
        folder, its files named ``L<layout>-shard<shard_id>-v…`` so they are never read as the first layout's."""
        layout = self.layout + 1 if layout is None else layout
        return ShardHost(shard_id, self.clock, self.lease_timeout, self._checkpoint_dir, self._checkpoint_every,
                         on_change=self._on_change, budget=self.budget, gauges=self._gauges,
                         join_timeout=self.join_timeout, layout=layout, wide=self.wide, metrics=self.metrics)

    @property
    def checkpoint_dir(self) -> str:
        """Where partition 0 checkpoints ('' : nowhere); a drain's record goes there too (psserver.resharding.drain_record)."""
        return self._checkpoint_dir

    # ------------------------------------------------------------------ partitions
    @property
    def head(self) -> Shard:
        """Partition 0: the sparse tables, the version a tool shows first."""
        return self.parts[0]

    def part(self, index: int) -> Shard:
        """Partition ``index`` of the job this shard runs.

        Without a job (a shard restarted empty) a partition past 0 is NotReady, FAILED_PRECONDITION like
        partition 0's "register first", so the trainer registers again; an index past the job's partitions
        is INVALID_ARGUMENT naming both numbers (partitions of an earlier job with more are not served).
        """
        job = self.head.job
        if job is None and 0 < index < len(self.parts):  # a rejoin registers partitions in parallel: this one
            job = self.parts[index].job                   # may hold its job before partition 0 does
        if job is None and index > 0:
            raise NotReady(f"shard {self.shard_id} has no job yet (partition is {index}): register first")
        count = min(job.partitions if job is not None else 1, len(self.parts))
        if not 0 <= index < count:
            raise InvalidRequest(f"partition is {index} but shard {self.shard_id} serves {count} partition"
                                 f"{'s' if count != 1 else ''} (0..{count - 1})")
        return self.parts[index]

    def part_for_register(self, index: int, rank: int, expected_shard: int, job: JobSpec,
                          join: bool = False) -> Shard:
        """Partition ``index`` of ``job``, created (with the ones before it) when the job is the first to have it.

        Everything ``Shard.register`` would refuse on the request alone (partition, shard order, rank, a spec
        that differs from the running job's) is refused before a partition is created: a refused Register
        makes nothing.  Once the running job has ended, the next may have any spec.  (Lock-free reads: the
        partition's own ``register`` checks again.)
        """
        if not 0 <= index < job.partitions:
            raise InvalidRequest(f"partition is {index} but the job has {job.partitions} partition"
                                 f"{'s' if job.partitions != 1 else ''} per shard (0..{job.partitions - 1})")
        self.head.admission.check_register(rank, expected_shard, job, join)
        running = self.head.job
        if join and (running is None or self.head.admission.job_ended()):  # a join fixes no job: nothing is planned or made
            raise no_job_to_join(f"shard {self.shard_id}", ended=running is not None)
        diff = (running.joiner_difference(job) if join else running.difference(job)) \
            if running is not None and not self.head.admission.job_ended() else ""
        if diff:
            if not join:  # the trainers waiting for this rank are told why it is not coming (Pulls.pull_wait_message)
                self.head.admission.register_refused(rank, diff)
            raise JobMismatch(f"job spec differs from the one this shard runs: {diff}")
        if running is None or self.head.admission.job_ended():
            self._admit(job)
        self._grow(job.partitions)
        return self.parts[index]

    def _admit(self, job: JobSpec) -> None:
        """Fit the job that this Register may fix in the memory budget and make everything it needs -- every
        partition's slice memory, the tables -- before any of it is recorded: a refusal or an allocation that
        fails leaves the shard as it was (no partition, plan or job more) and is RESOURCE_EXHAUSTED naming what
        did not fit.  The partitions take what was made when their first Register fixes the job there."""
        pending = self.head.prepared
        if pending is not None and not pending.job.difference(job):
            return  # admitted by an earlier Register whose state-worker half has not run yet
        plan = self.budget.plan(job, self.shard_id)
        made = self._prepare(job, plan)
        self._grow(job.partitions)
        for part, prep in zip(self.parts, made):
            part.hold_prepared(prep)
        self.plan = plan

    def _prepare(self, job: JobSpec, plan: Plan) -> list[Prepared]:
        """Allocate the job's slice memory (each partition's) and its tables; nothing is kept if one fails."""
        made, k = [], 0
        try:
            for k in range(job.partitions):
                start, end = partition_range(job.total_params, job.num_shards, job.partitions, self.shard_id, k)
                made.append(Prepared(job, allocate_slice(end - start)))
        except (MemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            raise OutOfMemory(f"total_params needs {plan.needs['total_params']} bytes on this shard (the shard's memory "
                              f"budget is {plan.limit} bytes) but partition {k}'s slice could not be allocated: "
                              f"{shorten(str(e), 200)}") from None
        try:
            tables = Tables.for_job(job, self.shard_id, plan.row_limits)
        except OutOfMemory as e:  # names the table; add what the plan gave the tables
            raise OutOfMemory(f"{e} (the job's tables were given {plan.tables_bytes} bytes of the shard's memory "
                              f"budget of {plan.limit} bytes)") from None
        made[0] = Prepared(job, made[0].buffer, tables)
        return made

    def _grow(self, count: int) -> None:
        count = min(count, MAX_PARTITIONS)  # the job spec bounds it too
        while len(self.parts) < count:
            self.parts.append(self._fresh(len(self.parts)))

    def _fresh(self, k: int) -> Shard:
        return Shard(self.shard_id, self.clock, self.lease_timeout, self._checkpointer(k), partition=k,
                     metrics=self.metrics, on_change=self._on_change, join_timeout=self.join_timeout)

    def _checkpointer(self, k: int) -> Checkpointer | None:
        if not self._checkpoint_dir:
            return None
        directory = Path(self._checkpoint_dir) if k == 0 else Path(self._checkpoint_dir) / f"partition-{k}"
        return Checkpointer(directory, self.shard_id, self._checkpoint_every, layout=self.layout)

    # ------------------------------------------------------------------ the whole shard
    def restore(self) -> int | None:
        """Partition 0 from its checkpoint, then every other partition its job had from theirs.  A partition
        whose newest checkpoint is of another job (or missing) starts empty, counted and logged: rank 0
        initialises it again, and the trainers resume it from there."""
        version = self.head.restore()
        if version is not None:  # made already: planned to bound its tables, never refused
            self.plan = self.budget.plan(self.head.job, self.shard_id, strict=False)
            self.head.tables.set_row_limits(self.plan.row_limits)
        if version is not None and self.head.job.partitions > 1:
            self._grow(self.head.job.partitions)
            for k, part in enumerate(self.parts[1:], start=1):
                if part.restore() is None:
                    self.count("partitions_restored_empty")
                    continue
                diff = self.head.job.difference(part.job)
                if diff:
                    log.warning("shard %d: partition %d's checkpoint is of another job (%s); it starts empty",
                                self.shard_id, k, diff)
                    self.count("partitions_restored_empty")
                    self.parts[k] = self._fresh(k)
        return version

    def restore_states(self, states: list, source: str, planned: bool = False,
                       counter: str = "reshard_restores", note: str = "") -> int:
        """Take the partitions' states re-cut from another shard count (psserver.resharding.reshard), partition 0 first,
        or a promoted standby's (psserver.replication); returns the version.  ``planned``: a live re-shard's switch
        or a promotion (Shard.restore_state)."""
        self._grow(len(states))
        for part, state in zip(self.parts, states):
            part.restore_state(state, source, note, planned=planned)
        self.count(counter)
        return states[0].version

    def capture_since(self, since: list | None) -> tuple[list[bytes], list, bool]:
        """Every partition's resumable state now, as a hot standby's shipment (on the state worker: one moment of
        the shard): each partition's tables with only the rows touched after its marks in ``since``, and its dense
        steps since then (Shard.state_since; one mark a partition; None: whole states), the marks now (the next
        one's base), and whether any state is partial (False: the states are whole)."""
        pairs = [p.state_since(since[i] if since else None) for i, p in enumerate(self.parts)]
        if any(state is None for state, _ in pairs):
            return [], [], False
        partial = any(state.dense_steps is not None or any("since" in t["rows"] for t in (state.tables or {}).values())
                      for state, _ in pairs)
        return [state.to_bytes(shipment=True) for state, _ in pairs], [marks for _, marks in pairs], partial

    def exposed(self) -> tuple:
        """Every partition's read counters (Shard.exposed)."""
        return tuple(p.exposed() for p in self.parts)

    def tick(self) -> float | None:
        """Every partition's leases and due rounds; the earliest next deadline."""
        deadlines = [d for d in (p.tick() for p in self.parts) if d is not None]
        return min(deadlines) if deadlines else None

    def snapshot(self, index: int = 0) -> StatsSnapshot:
        """Partition ``index``'s stats with every partition's counters summed (one shard's work, however cut),
        but for OWN_VALUES, which are partition ``index``'s; and the process's gauges."""
        snap = self.parts[index].snapshot()
        if len(self.parts) == 1:
            return self._with_memory(snap)
        total: Counter = Counter()
        for p in self.parts:
            total.update(p.snapshot().counters if p is not self.parts[index] else snap.counters)
        for key in OWN_VALUES:
            total.pop(key, None)
            if key in snap.counters:
                total[key] = snap.counters[key]
        return self._with_memory(replace(snap, counters=dict(total)))

    def _with_memory(self, snap: StatsSnapshot) -> StatsSnapshot:
        """Add the shard-wide counts (``wide``) and the budget's numbers: its limit, what the job reserved, the
        tables' share and what they hold now (the shard's own accounting, not RSS); and the serving process's
        gauges."""
        plan = self.plan
        memory = {"memory_budget_bytes": self.budget.limit, "memory_reserved_bytes": plan.total if plan else 0,
                  "memory_tables_budget_bytes": plan.tables_bytes if plan else 0,
                  "memory_tables_bytes": self.head.tables.memory_bytes()}
        counters = Counter(snap.counters)
        counters.update(self.wide.snapshot())
        return replace(snap, counters={**counters, **memory, **self._gauges()})

    def heartbeat(self, index: int, rank: int, trainer_id: str, fingerprint: str) -> tuple[int, int]:
        """Renew ``rank``'s lease on partition ``index`` -- and, from partition 0, on every partition it is a
        member of, so a trainer heartbeats once per shard however many partitions it has.  Safe on the loop."""
        version, live = self.part(index).heartbeat(rank, trainer_id, fingerprint)
        if index == 0:
            for part in self.parts[1:(self.head.job.partitions if self.head.job else 1)]:
                try:
                    part.heartbeat(rank, trainer_id, fingerprint)
                except PsError:  # not (yet, or any more) a member there: its own calls say so
                    pass
        return version, live

    def count(self, name: str, n: float = 1) -> None:
        """A count of this host's job (partition 0's, checkpointed with it); the servicer's go to ``wide``."""
        self.head.count(name, n)

    @property
    def version(self) -> int:
        return self.head.version

    def job_done(self) -> bool:
        return self.head.admission.job_done() and all(p.admission.job_done() or p.job is None for p in self.parts[1:])

    def checkpoint_layout(self, timeline: list) -> None:
        """This host serves a later layout from now on: stamp ``timeline`` (LayoutEpoch protos, serialised) on its
        partitions' checkpoints and write each one's state now, behind the caller (on the state worker, at the
        switch's round boundary)."""
        job = self.head.job
        for p in self.parts[:job.partitions if job is not None else 1]:
            p.checkpoints.layouts = timeline
            if p.job is not None:
                p.checkpoints.now(p.capture)

    def final_checkpoint(self, write: bool = True) -> None:
        """Every partition's final checkpoint; ``write`` False (a tombstone) stops the writers, writing nothing
        more."""
        for p in self.parts:
            if write:
                p.final_checkpoint()
            elif p.checkpoints.enabled:
                p.checkpoints.final(None)

    def stop(self) -> None:
        for p in self.parts:
            p.stop()
