"""The Python API: put an existing training loop on the parameter servers.

As with DDP, the change to a single-process loop is a few lines::

    ps = connect("10.0.0.1:7000,10.0.0.2:7000", model, mode="sync",
                 optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                 rank=rank, num_trainers=world)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ps.step(num_samples=len(x))   # instead of optimizer.step(); also zeroes the gradients
    ps.close()

The optimizer runs on the shards; ``step`` pushes each shard its slice of the
gradient and pulls fresh weights into the model.  The model's parameters and
gradients are views into one flat buffer each, so a pull writes straight into
the model and a push reads straight out of ``.grad``.  Buffers that get no
gradient (BatchNorm running statistics) stay local to each trainer.

The learning-rate schedule runs on the shards too
(``lr_schedule={"kind": "cosine", "cosine_steps": 1000, "warmup_steps": 50}``,
psserver.protocol.schedules): the rate follows the shards' version as
torch.optim.lr_scheduler's follows the step count.  ``clip_grad_norm=X`` clips
this trainer's own gradient before it is pushed (trainer.clipping) -- not the
averaged gradient a DDP user clips.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from typing import Sequence

import grpc
import torch

from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout, partition_range, partitions_for
from psserver.protocol.limits import MAX_PARTITIONS
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rules import Mode, reply_version
from psserver.protocol.schedules import LrSchedule
from psserver.protocol.security import ClientSecurity
from trainer.client import (
    LOOPBACK_REFUSED_SECONDS,
    RESTART_CODES,
    WAIT_LOG_SECONDS,
    PushOutcome,
    RetryPolicy,
    ShardCallsFailed,
    ShardClient,
    ShardedClient,
    on_loopback,
    parse_addresses,
)
from trainer.clipping import check_max_norm, clip_local_
from trainer.compress import parse_compress
from trainer.early_push import EarlyPusher
from trainer.embedding import sharded_tables
from trainer.pipeline import LayerWaits, OrderedGate
from trainer.staging import DeviceStaging
from trainer.stepper import StepInfo
from trainer.torchrun import rank_and_world

log = logging.getLogger(__name__)

# A shard that answers these to a push or pull has restarted: it does not know this trainer any more
# (NOT_FOUND), came back empty (FAILED_PRECONDITION: not initialised), or from an older checkpoint
# than our version (OUT_OF_RANGE).  The trainer registers again and resumes from the shard.


def model_layout(model: torch.nn.Module, num_shards: int) -> Layout:
    """The flat layout of ``model``'s trainable parameters over ``num_shards`` shards."""
    return Layout.from_shapes(
        ((n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()
         if p.requires_grad),
        num_shards,
    )


def make_job(model: torch.nn.Module, num_shards: int, *, mode: str = "sync", num_trainers: int = 1,
             optimizer: OptimizerConfig | dict | None = None, max_staleness: int | None = None,
             sync_timeout: float = 0.0, replicas_to_aggregate: int = 0, stale_policy: str = "drop",
             wire_dtype: str = "float32", job_id: str = "",
             lr_schedule: LrSchedule | dict | None = None, embedding_mode: str = "",
             partition_bytes: int = 0, partitions: int | None = None) -> JobSpec:
    """The job spec for training ``model`` (its shard-backed tables included); raises ValueError naming a
    bad setting."""
    layout = model_layout(model, num_shards)
    if optimizer is None:
        optimizer = OptimizerConfig()
    elif isinstance(optimizer, dict):
        optimizer = OptimizerConfig(**optimizer)
    if not isinstance(lr_schedule, LrSchedule):
        lr_schedule = LrSchedule(**(lr_schedule or {}))
    return JobSpec(
        mode=mode, num_trainers=num_trainers, num_shards=num_shards, total_params=layout.total,
        fingerprint=layout.fingerprint(), optimizer=optimizer, max_staleness=max_staleness,
        sync_timeout=sync_timeout, replicas_to_aggregate=replicas_to_aggregate, stale_policy=stale_policy,
        wire_dtype=wire_dtype, tensors=tuple((s.name, s.shape, s.dtype) for s in layout.slots), job_id=job_id,
        lr_schedule=lr_schedule, tables=table_specs(model, embedding_mode),
        partitions=partitions or job_partitions(layout, partition_bytes),
    )


def job_partitions(layout: Layout, partition_bytes: int) -> int:
    """Partitions per shard so that none holds more than ``partition_bytes`` of fp32 (0: one per shard)."""
    if partition_bytes < 0:
        raise ValueError(f"partition_bytes is {partition_bytes} but must be 0 (no partitions) or more bytes")
    largest = max((end - start for start, end in map(layout.shard_range, range(layout.num_shards))), default=0)
    return min(partitions_for(largest, partition_bytes), MAX_PARTITIONS)


def table_specs(model: torch.nn.Module, embedding_mode: str = "") -> tuple[TableSpec, ...]:
    """The specs of ``model``'s shard-backed tables (trainer.embedding), sorted by name.

    ``embedding_mode`` ("async" for async embeddings next to sync dense layers) is the mode of
    every table that names none itself; a table built with its own mode keeps it.
    """
    specs = [t.spec for t in sharded_tables(model)]
    return tuple(replace(s, mode=embedding_mode) if embedding_mode and not s.mode else s for s in specs)


def sharded_rows_class():
    """trainer.sparse_client.ShardedRows, imported only when a model has tables."""
    from trainer.sparse_client import ShardedRows
    return ShardedRows


class FlatModel:
    """Rebinds a model's trainable parameters and gradients as views of two flat buffers."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params and not sharded_tables(model):
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if dtypes - {torch.float32}:
            raise ValueError(f"psgrpc trains fp32 parameters; the model has {sorted(map(str, dtypes))}")
        device = self.params[0].device if self.params else torch.device("cpu")  # tables only: no dense part
        total = sum(p.numel() for p in self.params)
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.grad = torch.zeros(total, dtype=torch.float32, device=device)
        self._views = []
        self.ranges: list[tuple[int, int]] = []  # each parameter's [start, end) in the flat vector
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)
                p.grad = self.grad[offset : offset + n].view_as(p)
                self._views.append(p.grad)
                self.ranges.append((offset, offset + n))
                offset += n

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient; copies in any ``.grad`` a caller replaced (e.g. after zero_grad(set_to_none=True))."""
        for p, view in zip(self.params, self._views):
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
        return self.grad

    def zero_grad(self) -> None:
        self.grad.zero_()


LEFT, NOT_LISTED = "left", "not listed"  # what a shard answered a Leave: OK, or NOT_FOUND (it never knew us)


class StartTimeout(TimeoutError):
    """The job did not start within the connect timeout; the message says what was still awaited."""


class StepFailed(ShardCallsFailed):
    """A step that did not complete on every shard.

    An ``RpcError`` whose ``code()`` is the first failing shard's, so callers that
    handle a refusal by its code (ALREADY_EXISTS: fenced off) keep working.

    ``applied``: shards that acknowledged the gradient (and sent back weights or
    will); ``failed``: shard -> the error.  The gradients are kept: calling
    ``step()`` again retries the failed shards under the same sequence numbers,
    so a shard that did apply the gradient answers DUPLICATE -- it is never
    applied twice.  Do not run another backward before retrying.
    """

    def __init__(self, step: int, applied: list[int], failed: dict, addresses: Sequence[str],
                 names: Sequence[str] | None = None):
        self.applied = applied  # shards -- or, in a partitioned job, slots (shard * partitions + partition)
        what = "partitions" if names and any(" partition " in n for n in names) else "shards"
        done = f"{what} {applied} applied the gradient" if applied else "no shard is known to have applied it"
        super().__init__(f"step {step} failed ({self.causes(failed, addresses, names)}); {done}; call step() again to "
                         f"retry the others (a shard that applied it answers DUPLICATE), or close()", failed)


@dataclass
class _StepAttempt:
    """What is known of a step while it is retried: the shards still to do and what the others answered."""

    todo: set[int]
    acks: dict[int, PushOutcome] = field(default_factory=dict)  # pushed, but the pull is still to do
    outcomes: dict[int, str] = field(default_factory=dict)
    timings: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # push, pull, wait seconds
    produced: list = field(default_factory=list)  # CUDA: an event after the gradients, on the caller's stream
    staleness: dict[int, int] = field(default_factory=dict)  # versions each shard's push was behind
    sequences: dict[int, int] = field(default_factory=dict)  # the sequence number each shard's push carries
    started: dict[int, Future] = field(default_factory=dict)  # pushes begun during backward, not yet answered
    inflight: list[Future] = field(default_factory=list)  # other threads' calls of a try an interrupt cut short
    pipelined: bool = False  # runs behind the next forward (trainer.pipeline): slots land and zero one by one

    def applied(self) -> list[int]:
        """Shards known to hold this gradient (applied now or in a round): not lost, stale or skipped."""
        known = {**{i: a.outcome for i, a in self.acks.items()}, **self.outcomes}
        return sorted(i for i, o in known.items() if o in ("applied", "accepted", "duplicate", "scaled"))


def split_exchange(timings: list[tuple[float, float, float]], wall: float, partitioned: bool
                   ) -> tuple[float, float, float]:
    """(push, pull, wait) seconds of one step from its slots' own (push, pull, wait).

    Whole slices run one per shard, side by side: the slowest shard's of each.  Partitions overlap one another
    in every way (one pushing while another waits or pulls), so no slot's split is the step's: the exchange's
    wall time is split in the proportions the slots spent pushing, pulling and waiting -- the three add up to
    how long the exchange took, which ps-bench's overlap efficiency compares with compute."""
    if not partitioned:
        return tuple(max((t[i] for t in timings), default=0.0) for i in range(3))
    sums = [sum(t[i] for t in timings) for i in range(3)]
    total = sum(sums)
    return tuple(wall * part / total for part in sums) if total > 0 else (wall, 0.0, 0.0)


class ParameterServerTrainer:
    """A connected trainer; create it with :func:`connect`."""

    def __init__(self, addresses: Sequence[str], model: torch.nn.Module, job: JobSpec, rank: int,
                 trainer_id: str, connect_timeout: float, round_timeout: float, chunk_bytes: int,
                 security: ClientSecurity = ClientSecurity(), overlap: bool = False,
                 push_during_backward: bool = False, retry: RetryPolicy = RetryPolicy(),
                 clip_grad_norm: float | None = None, compress: str | None = None, pipeline: bool = False):
        self.tables = sharded_tables(model)  # bound to the shards once joined (_bind_tables)
        if pipeline and self.tables:
            raise ValueError("pipeline with shard-backed embedding tables is not supported: a table's pull in the "
                             "forward and the pipelined exchange could both rejoin a restarted shard at once")
        if pipeline and overlap:
            raise ValueError("pipeline and overlap both hide the pull behind compute: choose one (pipeline waits "
                             "per layer and keeps sync mode exact; overlap computes on weights one push old)")
        self.rows = None
        self._tables_pushed: set[str] = set()  # tables whose push of the current step is done
        self.clip_grad_norm = check_max_norm(clip_grad_norm, push_during_backward)
        if overlap and job.mode != Mode.ASYNC:
            raise ValueError(f"overlap (pulling the next weights while computing) needs async mode, not {job.mode}")
        self.overlap = overlap
        self._prefetch: dict[int, Future] = {}
        # Slots: every partition of every shard (job.partitions per shard; one when unpartitioned), in the flat
        # vector's order.  The dense exchange is per slot; tables and tools talk to shards.
        self.num_parts = job.num_shards * job.partitions
        self._prefetch_pool = ThreadPoolExecutor(max_workers=self.num_parts, thread_name_prefix="ps-prefetch")
        self.model, self.job, self.rank = model, job, rank
        self.forward_module = model  # what the training loop calls forward on
        self.round_timeout = round_timeout
        self.connect_timeout = connect_timeout
        self.layout = model_layout(model, job.num_shards)
        self.num_params = self.layout.total
        self.describe = f"{job.num_shards} shards, mode {job.mode}" + (
            f", {job.partitions} partitions each" if job.partitions > 1 else "") + (
            f", {len(job.tables)} sparse tables" if job.tables else "")
        self.flat = FlatModel(model)
        self._refused_limit = LOOPBACK_REFUSED_SECONDS if on_loopback(addresses) else None  # see ShardClient.register
        self.client = ShardedClient(addresses, job, rank, trainer_id, chunk_bytes=chunk_bytes, security=security,
                                    retry=retry, compress=compress)
        self.ranges = [partition_range(self.num_params, job.num_shards, job.partitions, j // job.partitions,
                                       j % job.partitions) for j in range(self.num_parts)]
        self._staging = [torch.empty(end - start) for start, end in self.ranges] if overlap else []
        self.versions = [0] * self.num_parts
        self.steps = 0
        self.staging = DeviceStaging(self.ranges, self.flat.flat.device)
        self._early = EarlyPusher(self.flat.params, self.flat._views, self.flat.ranges, self.ranges,
                                  self._push_shard, self.staging.produced if self.staging.active else None
                                  ) if push_during_backward else None
        # pipeline: step() hands the dense exchange to a thread; each module's forward waits for its own slots
        self._waits = LayerWaits(model, {id(p): r for p, r in zip(self.flat.params, self.flat.ranges)},
                                 self.ranges, self.staging.settle) if pipeline else None
        self._exchange_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-pipeline") if pipeline else None
        self._running: Future | None = None  # the pipelined exchange under way
        self._last_info: StepInfo | None = None
        self._closed = False
        self.left = False  # every shard that knew this trainer was told it left
        self.leave_answers: dict[int, str] = {}  # slot -> LEFT, NOT_LISTED or the error its Leave got
        self._attempt: _StepAttempt | None = None  # a step that failed on some shards, until step() retries it
        self._registered: set[int] = set()  # shards that know this trainer: close() leaves exactly these
        self._resume_dense: dict[int, int] = {}  # shard -> dense version before a restart a table call found
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        try:
            self._join(connect_timeout)
            self._bind_tables()
        except BaseException as e:
            # Leave and close, or this trainer would stay registered (and, with heartbeats, live): sync
            # rounds would wait on it.  The error carries what the shards answered: the caller holds no
            # trainer to ask (ps-trainer's SIGTERM while connecting reports it).
            self.close(leave=True, best_effort=True)
            e.left, e.leave_outcome = self.left, self.leave_outcome()
            raise
        log.info("rank %d connected to %d shards at versions %s", rank, job.num_shards, self.versions)

    def _join(self, timeout: float) -> None:
        """Register with every shard, start heartbeats, initialise (rank 0), and take the first weights --
        all within one ``timeout``."""
        give_up = time.monotonic() + timeout
        results = self._register_everywhere(timeout)
        self._registered = {i for i, r in enumerate(results) if not isinstance(r, Exception)}
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        for i, r in enumerate(results):
            if (r.start, r.end) != self.ranges[i]:
                raise ValueError(f"{self.client.parts[i].name} owns [{r.start}, {r.end}) but this trainer expected "
                                 f"{self.ranges[i]}")
        leases = [r.lease_seconds for r in results if r.lease_seconds > 0]
        if leases:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(min(leases) / 4,),
                                               name="ps-heartbeat", daemon=True)
            self._heartbeat.start()
        if self.rank == 0:
            ready = [self.staging.produced()] if self.staging.active else []
            self.client.map(lambda s: s.init(self.staging.to_host(s.slot, self._slice(self.flat.flat, s.slot), ready),
                                             self.client.wire) if not results[s.slot].initialized else None,
                            parts=True)
        self._wait_for_start(give_up - time.monotonic(), timeout)
        self.staging.settle()  # the first forward waits for the first weights

    def _register_everywhere(self, timeout: float) -> list:
        """Each slot's RegisterReply, or the Exception its registering raised.

        Interrupted meanwhile (a signal on this thread), the other slots' attempts are abandoned and waited
        for, and every slot whose registering did not fail stays in ``_registered``: a shard may have
        registered this trainer although its answer never arrived, and close() must leave it."""
        abandon, inflight = threading.Event(), []
        self._registered = set(range(self.num_parts))  # until their answers say otherwise
        try:
            return self.client.map_settled(lambda s: s.register(self.job, timeout, abandon, self._refused_limit),
                                           parts=True, inflight=inflight)
        except BaseException:
            abandon.set()
            futures_wait(inflight)
            self._registered -= {i + 1 for i, f in enumerate(inflight) if isinstance(f.result(), Exception)}
            raise

    def _bind_tables(self) -> None:
        """Point the model's tables at their rows on the shards."""
        if not self.tables:
            return
        self.rows = sharded_rows_class()(self.client, self.job)
        self.rows.on_restart = self._rejoin_for_tables
        for t in self.tables:
            t.bind(self.rows)

    def _push_tables(self, num_samples: int) -> None:
        """Each table's gradient rows, before the dense exchange.  A table whose push failed keeps its rows
        (the error propagates out of step()); the retry pushes the tables not yet done, and of those only to
        the shards that did not finish (ShardedRows keeps that)."""
        for t in self.tables:
            if t.name in self._tables_pushed:
                continue
            try:
                t.flush_gradients(num_samples)
            except grpc.RpcError as e:
                self.client.count("table_pushes_failed")
                log.warning("rank %d: the push of table %r failed (%s); step() again retries it", self.rank,
                            t.name, e)
                raise
            self._tables_pushed.add(t.name)

    def _wait_for_start(self, timeout: float, connect_timeout: float) -> None:
        """The first pull, which returns once every shard is initialised and (sync modes) every trainer has
        registered.  Polled in short calls so that what is awaited -- the shard's own words, e.g. "still
        waits for ranks [1] to register" -- is logged every few seconds instead of a silent wait."""
        give_up = time.monotonic() + timeout

        def first_pull(s: ShardClient) -> None:
            while True:
                poll = max(0.5, min(give_up - time.monotonic(), WAIT_LOG_SECONDS))
                try:
                    self.versions[s.slot] = self._pull_into(s, 0, poll)
                    return
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    if time.monotonic() >= give_up:
                        raise StartTimeout(f"rank {self.rank} gave up waiting after {connect_timeout:g} s "
                                           f"(--connect-timeout): {s.name} at {s.address}: {e.details()}"
                                           ) from None
                    log.info("rank %d waiting to start: %s at %s: %s", self.rank, s.name, s.address,
                             e.details())

        self.client.map(first_pull, parts=True)

    def _rejoin(self, s: ShardClient, cause: grpc.RpcError) -> bool:
        """The shard restarted (it no longer knows us, or is behind us): register again and resume from it.

        Rank 0 re-initialises a shard that came back empty (no checkpoint) with
        its current weights.  The steps the shard lost are logged and counted.
        Returns whether this step's gradient is to be pushed to it again (see _exchange).
        """
        before = self.versions[s.slot]
        again = s.resend_after_restart()
        self._register_again(s, cause)
        self._resume_dense[s.slot] = before
        self._resume_dense_slice(s, dropped=not again)
        return again

    def _rejoin_for_tables(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """A table call found shard ``s`` restarted (ShardedRows.on_restart): register again and resync the
        tables now; the dense slice resumes at this step's dense exchange, not here -- a pull inside the
        forward would overwrite weights the forward may already have used."""
        self._resume_dense.setdefault(s.slot, self.versions[s.slot])  # a second restart keeps the first
        s.abandon_push()  # the restarted shard does not know it: the next push gets a new number
        self._register_again(s, cause)

    def _resume_dense_slice(self, s: ShardClient, dropped: bool = False) -> None:
        """Pull shard ``s``'s weights after it was rejoined and count what it lost (see _rejoin)."""
        i = s.slot
        before = self._resume_dense.pop(i)
        v = self.versions[i] = self._pull_into(s, 0, self.connect_timeout)
        # Lost: the versions the shard rolled back, plus this step's gradient if it could not be pushed again.
        lost = max(0, before - v) + dropped
        self.client.count("steps_lost", lost)
        log.warning("rank %d resumed %s at version %d (was %d): %d steps lost", self.rank, s.name, v, before, lost)

    def _register_again(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """Register with a restarted shard (rank 0 re-initialises it if it came back empty) and resync the
        tables from it; counted in ``reconnects``."""
        i = s.slot
        pending = self._prefetch.pop(i, None)
        if pending is not None:  # a background pull from before the restart: its weights are void
            try:
                pending.result()
            except grpc.RpcError:
                pass
        log.warning("%s (%s) answered %s (%s): it restarted; registering again", s.name, s.address,
                    cause.code().name, cause.details())
        reply = s.register(self.job, self.connect_timeout)
        if not reply.initialized and self.rank == 0:
            ready = [self.staging.produced()] if self.staging.active else []
            s.init(self.staging.to_host(i, self._slice(self.flat.flat, i), ready), self.client.wire)
            log.warning("%s came back without parameters: re-initialised it from rank 0's weights", s.name)
        self.client.count("reconnects")
        if self.rows is not None and s.partition == 0:  # the tables live on partition 0
            counters = s.stats().counters
            versions = {name: int(counters.get(f"table.{name}.version", 0)) for name in self.rows.tables}
            before = {name: v[s.index] for name, v in self.rows.versions().items()}
            lost = sum(max(0, before[name] - v) for name, v in versions.items())
            self.rows.resync(s.index, versions)
            log.warning("rank %d resumed the tables on shard %d at versions %s (was %s): %d table versions lost",
                        self.rank, s.index, versions, before, lost)

    def _heartbeat_loop(self, interval: float) -> None:
        """Keeps this trainer's lease while it computes or waits; a dead process stops sending.

        Every slot's channel is probed, side by side: a heartbeat on a connection that died half-open (a
        dropped link) fails it at once, so a call in flight on it is retried instead of waiting ~30 s for
        keepalive (measured: without them, the partition fault soak stalled 30 s per dropped connection);
        side by side, one hung shard delays no other shard's heartbeats.  (Partition 0's also renews the
        lease on every partition of its shard: psserver.host.)"""
        with ThreadPoolExecutor(max_workers=min(16, len(self.client.parts)), thread_name_prefix="ps-beat") as beats:
            while not self._stop_heartbeat.wait(interval):
                futures_wait([beats.submit(self._heartbeat_once, s, interval) for s in self.client.parts])

    def _heartbeat_once(self, s: ShardClient, timeout: float) -> None:
        try:
            s.heartbeat(timeout=timeout)
        except grpc.RpcError as e:
            self.client.count("heartbeat_failures")
            log.warning("heartbeat to %s (%s) failed: %s %s", s.name, s.address, e.code().name, e.details())

    def _pull_into(self, s: ShardClient, min_version: int, timeout: float, with_wait: bool = False):
        """Pull shard ``s``'s weights straight into the model (via a copy only when they live on a GPU)."""
        target = self._slice(self.flat.flat, s.slot)
        landing = self.staging.weights_buffer(s.slot, target)  # the model itself on the CPU
        v, _, waited = s.pull(min_version, self.client.wire, target.numel(), timeout, out=landing)
        with torch.no_grad():
            self.staging.weights_to_device(s.slot, target)
        return (v, waited) if with_wait else v

    def _slice(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        start, end = self.ranges[shard]
        return flat[start:end]

    def prepare_step(self, num_samples: int) -> None:
        """Announce that the next backward is the last before step(), on ``num_samples`` samples.

        With ``push_during_backward`` this lets each shard's push start as soon as
        backward has produced its slice; without it (or if never called) it does nothing.
        """
        self._no_pending_step("prepare_step()")
        if self._early is not None:
            self._early.prepare(num_samples)

    def _no_pending_step(self, what: str) -> None:
        """A failed step's gradient is waiting to be retried: anything that changes it first is refused
        (a retry would push the changed gradient under the old sequence numbers).  A pipelined exchange still
        running is not a failed step."""
        if self._running is not None and not self._running.done():
            return
        if self._running is not None:
            self._join_exchange()  # it ended: a failure is raised here, as StepFailed
        if self._attempt is not None or any(t.push_pending for t in self.tables):
            raise RuntimeError(f"{what} while a failed step waits: call step() to retry it (same gradient, "
                               f"same sequence numbers) or abandon_step() to drop it")

    def abandon_step(self) -> None:
        """Drop a failed step instead of retrying it: the shards that did not answer may or may not have
        applied it (counted in ``steps_abandoned``); the gradients are zeroed and the next step is a new one."""
        if self._running is not None:  # a pipelined exchange: wait for it; only a failed one has anything to drop
            try:
                self._join_exchange()
            except grpc.RpcError:
                pass
        if self._attempt is None and not any(t.push_pending for t in self.tables):
            return
        todo = sorted(self._attempt.todo) if self._attempt is not None else []  # [] : only a table push failed
        for i in todo:
            self.client.parts[i].abandon_push()
        abandon = getattr(self.rows, "abandon", None)  # ShardedRows; a local backend keeps no failed push
        for t in self.tables:  # the shards that did not answer a table's push: new numbers there too
            if t.push_pending and abandon is not None and abandon(t.name):
                self.client.count("table_pushes_abandoned")
        log.warning("rank %d abandoned a failed step on shards %s", self.rank, todo)
        self._attempt = None
        if self._waits is not None:
            self._waits.finished(None)  # no forward waits for the abandoned step's slots
        self.client.count("steps_abandoned")
        self.flat.zero_grad()
        self._zero_tables()

    def _push_shard(self, shard: int, num_samples: int, after: Sequence = ()):
        """Push ``shard`` its gradient slice (on CUDA: once the ``after`` events, the gradient's, have passed)."""
        s = self.client.parts[shard]
        grad = self.staging.to_host(shard, self._slice(self.flat.grad, shard), after)
        return s.push(grad, self.versions[shard], num_samples, self.client.wire)

    def step(self, num_samples: int = 1) -> StepInfo:
        """Push the gradients in ``.grad`` and the tables' gradient rows, pull fresh weights into the model,
        zero the gradients.

        All or nothing from the caller's view: if a shard fails, StepFailed names
        the shards that applied the gradient, the gradients stay, and calling
        ``step()`` again retries only the rest, under the same sequence numbers.
        A table push that fails raises its grpc.RpcError; the retry pushes only
        the tables (and shards) not done, then the dense step.
        """
        if self._waits is not None:
            return self._pipelined_step(num_samples)
        self._push_tables(num_samples)
        info = self._dense_step(num_samples)
        self._tables_pushed.clear()
        return info

    # ------------------------------------------------------------------ pipelined steps (trainer.pipeline)
    def _pipelined_step(self, num_samples: int) -> StepInfo:
        """Start the dense exchange behind the next forward and return; the StepInfo returned is the previous
        step's (this one's is not known yet), or one with outcomes "pending" for the first."""
        previous = self._join_exchange()  # the last one's failure is raised here, as StepFailed
        self._push_tables(num_samples)
        if self._attempt is not None:  # a failed step retried: in the foreground, every slot landed on return
            info = self._dense_step(num_samples)
            self._tables_pushed.clear()
            self._waits.finished(None)
            self.staging.settle()  # (a pipelined attempt leaves settling to the forward's hooks, which now rest)
            return info
        started = {}
        if self._early is not None:  # pushes begun during backward are handed to the exchange here, on this
            started = {j: f for j in range(self.num_parts)  # thread, so the next prepare_step() starts clean
                       if (f := self._early.take(j, num_samples)) is not None}
            self._early.finish_step()
        self._attempt = _StepAttempt(todo=set(range(self.num_parts)), started=started, pipelined=True,
                                     produced=[self.staging.produced()] if self.staging.active else [])
        self._tables_pushed.clear()
        self._waits.begin()
        self._running = self._exchange_thread.submit(self._background_step, num_samples)
        return previous or StepInfo(versions=list(self.versions), outcomes=["pending"] * self.num_parts,
                                    push_seconds=0.0, pull_seconds=0.0, wait_seconds=0.0)

    def take_forward_wait(self) -> float:
        """Seconds forwards spent waiting for pipelined slots since the last call (0 unpipelined): the training
        loop counts them as waiting for the exchange, not as compute."""
        if self._waits is None:
            return 0.0
        waited, self._waits.waited_seconds = self._waits.waited_seconds, 0.0
        return waited

    def _background_step(self, num_samples: int) -> StepInfo:
        error = None
        try:
            return self._dense_step(num_samples)
        except BaseException as e:
            error = e
            raise
        finally:
            self._waits.finished(error)

    def _join_exchange(self) -> StepInfo | None:
        """Wait for the pipelined exchange under way, if any; its StepInfo, or its StepFailed raised -- once:
        a failure a forward already raised returns None here (the caller's step() retries it).  Interrupted
        while waiting (Ctrl-C), the exchange is still under way and stays to be joined."""
        running = self._running
        if running is None:
            return None
        try:
            return running.result()
        except BaseException:
            if running.done():
                if self._waits.error_reported:
                    return None
                self._waits.error_reported = True
            raise
        finally:
            if running.done():
                self._running = None
                self.staging.settle()  # the caller's stream waits for every slot's weights

    def _dense_step(self, num_samples: int) -> StepInfo:
        """The dense part of step(): every shard its gradient slice, and the weights back."""
        grad = self.flat.gather_grads()
        if self._attempt is None:  # a retried step pushes the same, already clipped, gradient
            clip_local_(self.flat.params, self.clip_grad_norm)  # this trainer's gradient, not the round's average
        # Recorded before the fan-out, and each shard's result as it comes: however step() is left (an error,
        # KeyboardInterrupt), the next call knows which shards are done and retries only the others.
        attempt = self._attempt = self._attempt or _StepAttempt(todo=set(range(self.num_parts)))
        futures_wait(attempt.inflight)  # an interrupted try's calls on other threads finish first
        attempt.inflight.clear()
        if not attempt.pipelined:  # (pipelined: recorded by step() on the caller's thread, before this one ran)
            attempt.produced = [self.staging.produced()] if self.staging.active else []  # the caller's gradients
        todo = sorted(attempt.todo)
        t_exchange = time.perf_counter()
        # Partitioned: slots start in the flat vector's order, so the partitions the next forward needs first
        # go first (trainer.pipeline.OrderedGate).  No cap on how many run at once: capping at two per shard
        # (one pushing, one pulling) measured slower on 2 cores -- ResNet-18 37.5-40.8 vs 41.6-42.7 samples/s,
        # the 23M MLP 158 vs 213 -- as each group of rounds waits for the slowest trainer in turn.
        gate = OrderedGate(todo, len(todo)) if self.job.partitions > 1 else None
        try:
            results = self.client.map_settled(lambda s: self._exchange(s, grad, num_samples, attempt, gate),
                                              None if len(todo) == self.num_parts else todo, attempt.inflight,
                                              parts=True) if todo else []
        finally:
            if not attempt.pipelined:  # (a pipelined step's forward settles slot by slot, on its own thread)
                if self._early is not None:
                    self._early.finish_step()
                self.staging.settle()  # the next forward, on the caller's stream, waits for the new weights
        if attempt.todo:
            self.client.count("steps_failed")
            failed = {i: r for i, r in zip(todo, results) if isinstance(r, Exception)}
            error = StepFailed(self.steps + 1, attempt.applied(), failed, [s.address for s in self.client.parts],
                               [s.name for s in self.client.parts])
            log.warning("rank %d: %s", self.rank, error)
            raise error from next(iter(failed.values()))
        self._attempt = None
        if not attempt.pipelined:  # pipelined: each slot was zeroed as it landed (the next backward may run)
            self.flat.zero_grad()
        self.steps += 1
        outcomes = [attempt.outcomes[i] for i in range(self.num_parts)]
        push, pull, wait = split_exchange(list(attempt.timings.values()), time.perf_counter() - t_exchange,
                                          self.job.partitions > 1)
        return StepInfo(
            versions=list(self.versions), outcomes=outcomes, push_seconds=push, pull_seconds=pull,
            wait_seconds=wait, stale=outcomes.count("stale"), staleness=max(attempt.staleness.values(), default=0),
        )

    def _exchange(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: _StepAttempt,
                  gate: OrderedGate | None = None) -> str:
        """One shard's (partition's) part of a step, started in the gate's order."""
        if gate is not None:
            gate.enter(s.slot)
        try:
            return self._exchange_slot(s, grad, num_samples, attempt)
        finally:
            if gate is not None:
                gate.leave()

    def _exchange_slot(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: _StepAttempt) -> str:
        """A shard found restarted is rejoined and this step's gradient pushed to it again, on the version it
        resumed at: the rounds the restart rolled back are lost, this step is not.  (Dropped, it left this
        trainer a step ahead there of a peer whose unanswered push was retried into the restored round, while
        the other shards' rounds kept them paired: in sync mode each waited for the other --
        tests/cluster/test_partition_faults.py.)"""
        outcome = None
        try:
            if s.slot in self._resume_dense:  # a table call of this step rejoined it: its weights are due
                self._resume_dense_slice(s)
            else:
                outcome = self._exchange_once(s, grad, num_samples, attempt)
        except grpc.RpcError as e:
            if e.code() not in RESTART_CODES:
                raise
            if not self._rejoin(s, e):
                outcome = "lost"
        if outcome is None:  # rejoined: a push of its own, answered by the restarted shard
            attempt.acks.pop(s.slot, None)
            attempt.sequences.pop(s.slot, None)
            outcome = self._exchange_once(s, grad, num_samples, attempt)
        if outcome == "lost":
            attempt.acks.pop(s.slot, None)
            attempt.timings[s.slot] = (0.0, 0.0, 0.0)
        attempt.outcomes[s.slot] = outcome
        attempt.todo.discard(s.slot)
        if attempt.pipelined:
            self.staging.zero(s.slot, self._slice(self.flat.grad, s.slot))
            self._waits.landed(s.slot)
        return outcome

    def _exchange_once(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: _StepAttempt) -> str:
        i = s.slot
        t0 = time.perf_counter()
        out = self._answered_push(s, attempt)  # pushed in an earlier try of this step: only the pull is left
        if out is None:
            started = attempt.started.get(i) or (
                self._early.take(i, num_samples) if self._early and not attempt.pipelined else None)
            if started is None:
                attempt.sequences.setdefault(i, s.next_sequence())
                if not self.overlap:
                    return self._push_pull(s, grad, num_samples, attempt, t0)
                out = self._push_shard(i, num_samples, attempt.produced)
            else:  # a push begun during backward: step() waits for what is left of it
                attempt.started[i] = started
                try:
                    out = started.result()
                finally:
                    if started.done():  # answered, or failed: a retry pushes again under the same number
                        attempt.started.pop(i, None)
            attempt.acks[i] = out
        attempt.staleness[i] = out.staleness
        t1 = time.perf_counter()
        if self.overlap:
            # Take the weights pulled while this gradient was computed, then pull the next ones in the
            # background while the next gradient is computed (on these: one push staler than otherwise).
            self._collect_prefetch(i)
            self._prefetch[i] = self._prefetch_pool.submit(self._pull_staged, s, out.version)
            attempt.timings[i] = (t1 - t0, time.perf_counter() - t1, 0.0)
            return out.outcome
        # async: its own step; stale: catch up with the shard; sync: the close of this gradient's round
        wanted = reply_version(self.job.mode, out.outcome, self.versions[i], out.version)
        self.versions[i], waited = self._pull_into(s, wanted, self.round_timeout, with_wait=True)
        attempt.timings[i] = (t1 - t0, time.perf_counter() - t1 - waited, waited)
        return out.outcome

    @staticmethod
    def _answered_push(s: ShardClient, attempt: _StepAttempt) -> PushOutcome | None:
        """What shard ``s`` answered to this step's push, if it did -- also when the answer came but an
        interrupt hit before it was recorded (the shard client remembers its last answer and its number)."""
        if s.slot not in attempt.acks and s.last_answer is not None and (
                s.last_answer[0] == attempt.sequences.get(s.slot)):
            attempt.acks[s.slot] = s.last_answer[1]
        return attempt.acks.get(s.slot)

    def _push_pull(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: _StepAttempt,
                   t0: float) -> str:
        """The plain path: one PushPull call, whose reply is the weights to go on from."""
        i = s.slot
        target = self._slice(self.flat.flat, i)
        landing = self.staging.weights_buffer(i, target)  # the model itself on the CPU
        out, _, pushed, waited = s.push_pull(self.staging.to_host(i, self._slice(grad, i), attempt.produced),
                                             self.versions[i], num_samples, self.client.wire, self.round_timeout,
                                             out=landing)
        with torch.no_grad():
            self.staging.weights_to_device(i, target)
        self.versions[i] = out.version
        attempt.staleness[i] = out.staleness
        attempt.timings[i] = (pushed, time.perf_counter() - t0 - pushed - waited, waited)
        return out.outcome

    # ------------------------------------------------------------------ async overlap
    def _pull_staged(self, s: ShardClient, min_version: int) -> int:
        """Background pull of shard ``s`` into its staging buffer (the model is in use meanwhile)."""
        v, _, _ = s.pull(min_version, self.client.wire, self._staging[s.slot].numel(), self.round_timeout,
                         out=self._staging[s.slot])
        return v

    def _collect_prefetch(self, i: int) -> None:
        """Wait for shard ``i``'s background pull, if any, and copy its weights into the model."""
        fut = self._prefetch.pop(i, None)
        if fut is None:
            return
        v = fut.result()
        with torch.no_grad():
            self._slice(self.flat.flat, i).copy_(self._staging[i])
        self.versions[i] = v

    def flush(self) -> None:
        """Bring in the weights still being pulled in the background (before evaluating or saving); a
        pipelined exchange's failure is raised here as StepFailed."""
        self._join_exchange()
        for i in list(self._prefetch):
            self._collect_prefetch(i)

    def zero_grad(self) -> None:
        self._join_exchange()
        self._no_pending_step("zero_grad()")
        self.flat.zero_grad()
        self._zero_tables()

    def _zero_tables(self) -> None:
        """Forget the tables' rows and gradients of this step (and any failed push of them)."""
        for t in self.tables:
            t.zero_grad_rows()
        self._tables_pushed.clear()

    @property
    def counters(self) -> dict:
        rows = {f"rows_{k}": v for k, v in self.rows.counters.items()} if self.rows is not None else {}
        return {**self.client.counters, **rows}

    def shard_stats(self) -> list:
        """Every shard's stats (partition 0's version and range; counters of all its partitions)."""
        return self.client.map(lambda s: s.stats())

    def close(self, leave: bool = True, best_effort: bool = False) -> None:
        """Leave the job (so rounds stop waiting for this trainer) and close the channels.

        ``best_effort`` (closing after another error or an interrupt): each Leave is
        one quick try from this thread -- not the I/O pool, which calls stuck in a
        round may still hold -- and a failure is logged, not raised; closing the
        channels then cancels whatever is still in flight.  ``left`` says whether
        every shard was told.  Closing twice does nothing the second time.
        """
        if self._closed:
            return
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()  # before the channels close under it
        try:
            if not best_effort:
                try:
                    self.flush()
                except grpc.RpcError as e:  # leaving matters more than the weights still being pulled
                    log.warning("rank %d: the weights pulled in the background were lost: %s %s", self.rank,
                                e.code().name, e.details())
            if leave:
                self._leave(best_effort)
        finally:
            self._closed = True
            if self.rows is not None:
                self.rows.close()
            self.client.close()  # channels first: cancels calls still in flight, so the pools below drain
            self._prefetch_pool.shutdown(wait=True)
            if self._exchange_thread is not None:
                self._exchange_thread.shutdown(wait=True)
                self._waits.close()
            if self._early is not None:
                self._early.close()

    def _leave(self, best_effort: bool) -> None:
        mine = [s for s in self.client.parts if s.slot in self._registered]
        if not best_effort:
            self.client.map(lambda s: s.leave() if s.slot in self._registered else None, parts=True)
            self.leave_answers = {s.slot: LEFT for s in mine}
            self.left = True
            return
        for s in mine:
            try:
                s.leave(quick=True)
                self.leave_answers[s.slot] = LEFT
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:  # it does not list this trainer: nothing to leave
                    self.leave_answers[s.slot] = NOT_LISTED
                    continue
                self.leave_answers[s.slot] = f"{e.code().name}: {e.details()}"
                log.warning("rank %d could not leave %s (%s): %s %s", self.rank, s.name, s.address,
                            e.code().name, e.details())
        self.left = all(a in (LEFT, NOT_LISTED) for a in self.leave_answers.values())

    def leave_outcome(self) -> str:
        """What closing told the shards, in words that claim no more than their answers (for ps-trainer's last
        line): left, had registered nowhere, or could not leave which shard and why."""
        failed = {i: a for i, a in self.leave_answers.items() if a not in (LEFT, NOT_LISTED)}
        if failed:
            names = "; ".join(f"{self.client.parts[i].name} at {self.client.parts[i].address} ({a})"
                              for i, a in sorted(failed.items()))
            return f"could not leave {names}: its lease there runs out instead"
        told = sorted(self.client.parts[i].name for i, a in self.leave_answers.items() if a == LEFT)
        if told:
            return f"left the job ({', '.join(told)} answered its Leave)"
        return "had registered with no shard: nothing to leave"

    def __enter__(self) -> "ParameterServerTrainer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # After an error, leaving is best effort: a failing Leave must not hide the error that ended the block.
        self.close(best_effort=exc_type is not None)


def default_trainer_id(rank: int) -> str:
    return f"rank{rank}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def connect(ps: str | Sequence[str], model: torch.nn.Module, *, mode: str = "sync", rank: int | None = None,
            num_trainers: int | None = None, optimizer: OptimizerConfig | dict | None = None,
            max_staleness: int | None = None, sync_timeout: float = 0.0, replicas_to_aggregate: int = 0,
            stale_policy: str = "drop", wire_dtype: str = "float32", trainer_id: str | None = None,
            connect_timeout: float = 120.0, round_timeout: float = 600.0,
            chunk_bytes: int = 1 << 20, security: ClientSecurity | None = None,
            overlap: bool = False, push_during_backward: bool = False, job_id: str = "",
            retry_budget: float = 60.0, lr_schedule: LrSchedule | dict | None = None,
            clip_grad_norm: float | None = None, compress: str | None = None,
            embedding_mode: str = "", partition_bytes: int = 0, partitions: int | None = None,
            pipeline: bool = False) -> ParameterServerTrainer:
    """Register ``model`` with the shards at ``ps`` and return a handle whose ``step()`` trains it.

    ``rank`` and ``num_trainers`` not given are read from ``RANK`` and ``WORLD_SIZE``
    as torchrun sets them (else 0 and 1; trainer.torchrun).
    Rank 0 initialises the shards with its model's weights; every trainer then
    starts from the shards' weights.  Raises ValueError for a bad setting and
    grpc.RpcError (FAILED_PRECONDITION, with the difference named) when the
    shards run a different job.  ``security`` carries TLS files and the token
    (see psserver.protocol.security).  ``overlap`` (async mode only) pulls the next
    weights in the background while the next gradient is computed.
    ``push_during_backward`` (any mode) starts each shard's push as soon as
    backward has produced its slice; call ``prepare_step(num_samples)`` before
    ``loss.backward()`` (see trainer.early_push).  ``job_id`` names this run: while
    a job runs, shards refuse trainers of another id (FAILED_PRECONDITION naming
    both); once every trainer of a job has left, the next job starts fresh.
    ``retry_budget``: seconds one call is retried after UNAVAILABLE (a shard
    restarting) before ``step()`` raises StepFailed.  Use it as a context
    manager (``with connect(...) as ps:``) to leave the job on every way out.
    ``lr_schedule`` (an LrSchedule or its fields as a dict) is applied by the
    shards from their version; ``clip_grad_norm`` clips this trainer's own
    gradient to that 2-norm before each push (trainer.clipping).  ``compress="topk:RATIO"`` pushes each
    shard only the largest RATIO of its slice, keeping the rest for later pushes (trainer.compress).

    Partitions: ``partition_bytes=N`` cuts each shard's slice into pieces of at most N bytes, each with its
    own round on the shard (psserver.host), pushed and pulled on its own (every trainer of a job must agree);
    ``partitions=K`` asks for K per shard instead.
    ``pipeline=True`` returns from ``step()`` while the exchange goes on: each module's next forward waits
    only for the partitions holding its parameters (trainer.pipeline); ``step()`` then returns the previous
    step's StepInfo.  In sync mode both leave the parameters bit-identical to the plain exchange.

    Tables: the model's ShardedEmbedding / ShardedEmbeddingBag modules (trainer.embedding)
    join the job as its sparse tables (sorted by name) and are bound to their rows on
    the shards; ``step()`` pushes their gradient rows too.  ``embedding_mode="async"``
    runs every table that names no mode itself asynchronously next to the dense
    layers' ``mode`` (the usual recommender recipe).
    """
    if retry_budget < 0:
        raise ValueError(f"retry_budget is {retry_budget} but must be zero or more seconds")
    rank, num_trainers = rank_and_world(rank, num_trainers)
    parse_compress(compress)  # a bad value is refused before anything starts
    addresses = parse_addresses(ps)
    job = make_job(model, len(addresses), mode=mode, num_trainers=num_trainers, optimizer=optimizer,
                   max_staleness=max_staleness, sync_timeout=sync_timeout,
                   replicas_to_aggregate=replicas_to_aggregate, stale_policy=stale_policy, wire_dtype=wire_dtype,
                   job_id=job_id, lr_schedule=lr_schedule, embedding_mode=embedding_mode,
                   partition_bytes=partition_bytes, partitions=partitions)
    return ParameterServerTrainer(addresses, model, job, rank, trainer_id or default_trainer_id(rank),
                                  connect_timeout, round_timeout, chunk_bytes, security or ClientSecurity(), overlap,
                                  push_during_backward, RetryPolicy(budget_seconds=retry_budget),
                                  clip_grad_norm=clip_grad_norm, compress=compress, pipeline=pipeline)
