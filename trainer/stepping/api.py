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
this trainer's own gradient before it is pushed (trainer.stepping.clipping) -- not the
averaged gradient a DDP user clips.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import replace
from typing import Sequence

import grpc
import torch

from psserver.protocol.epochs import Epoch
from psserver.protocol.job import JobSpec, OptimizerConfig, table_mode
from psserver.protocol.layout import Layout, partitions_for
from psserver.protocol.limits import MAX_PARTITIONS, MAX_PUSH_WINDOW
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rules import Mode
from psserver.protocol.schedules import LrSchedule
from psserver.protocol.security import ClientSecurity
from trainer.stepping.attempt import StepFailed, split_exchange  # noqa: F401 -- re-exported: callers catch StepFailed here
from trainer.channels.client import LOOPBACK_REFUSED_SECONDS, RetryPolicy, ShardedClient, on_loopback, parse_addresses
from trainer.stepping.clipping import check_max_norm
from trainer.channels.compress import parse_compress
from trainer.stepping.early_push import EarlyPusher
from trainer.tables.embedding import sharded_tables
from trainer.stepping.exchange import DenseExchange
from trainer.tables.lookahead import prefetching
from trainer.stepping.overlap import Prefetcher
from trainer.stepping.pipeline import LayerWaits
from trainer.stepping.pipelined import PipelinedExchange
from trainer.membership.relayout import Relayout
from trainer.membership.session import Membership, Session, StartTimeout  # noqa: F401 -- re-exported
from trainer.membership.slots import DenseSlots, FlatModel, model_layout
from trainer.stepping.step import StepRunner
from trainer.stepping.step_call import StepCall
from trainer.stepping.stepper import StepInfo
from trainer.stepping.table_push import TablePush
from trainer.membership.torchrun import rank_and_world
from trainer.stepping.windowed import WindowedExchange

log = logging.getLogger(__name__)

def make_job(model: torch.nn.Module, num_shards: int, *, mode: str = "sync", num_trainers: int = 1,
             optimizer: OptimizerConfig | dict | None = None, max_staleness: int | None = None,
             sync_timeout: float = 0.0, replicas_to_aggregate: int = 0, stale_policy: str = "drop",
             wire_dtype: str = "float32", job_id: str = "",
             lr_schedule: LrSchedule | dict | None = None, embedding_mode: str = "",
             partition_bytes: int = 0, partitions: int | None = None, max_trainers: int = 0,
             lr_scaling: str = "none") -> JobSpec:
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
        partitions=partitions or job_partitions(layout, partition_bytes), max_trainers=max_trainers,
        lr_scaling=lr_scaling,
    )


def job_partitions(layout: Layout, partition_bytes: int) -> int:
    """Partitions per shard so that none holds more than ``partition_bytes`` of fp32 (0: one per shard)."""
    if partition_bytes < 0:
        raise ValueError(f"partition_bytes is {partition_bytes} but must be 0 (no partitions) or more bytes")
    largest = max((end - start for start, end in map(layout.shard_range, range(layout.num_shards))), default=0)
    return min(partitions_for(largest, partition_bytes), MAX_PARTITIONS)


def table_specs(model: torch.nn.Module, embedding_mode: str = "") -> tuple[TableSpec, ...]:
    """The specs of ``model``'s shard-backed tables (trainer.tables.embedding), sorted by name.

    ``embedding_mode`` ("async" for async embeddings next to sync dense layers) is the mode of
    every table that names none itself; a table built with its own mode keeps it.
    """
    specs = [t.spec for t in sharded_tables(model)]
    return tuple(replace(s, mode=embedding_mode) if embedding_mode and not s.mode else s for s in specs)


def has_async_tables(job: JobSpec) -> bool:
    """A table of ``job`` runs async (its own mode, or the job's): such rows cannot follow a layout switch yet."""
    return any(table_mode(t, job) == Mode.ASYNC for t in job.tables)


def sharded_rows_class():
    """trainer.tables.sparse_client.ShardedRows, imported only when a model has tables."""
    from trainer.tables.sparse_client import ShardedRows
    return ShardedRows


class ParameterServerTrainer:
    """A connected trainer; create it with :func:`connect`.

    A facade: the session (trainer.membership.session) joins, keeps the lease, rejoins and leaves and knows the membership;
    the dense exchange (trainer.stepping.exchange, with trainer.stepping.overlap, trainer.stepping.pipelined and trainer.stepping.windowed) and the
    tables' push (trainer.stepping.table_push) make the steps, which trainer.stepping.step runs; this class builds them and hands
    each what it calls.
    """

    def __init__(self, addresses: Sequence[str], model: torch.nn.Module, job: JobSpec, rank: int,
                 trainer_id: str, connect_timeout: float, round_timeout: float, chunk_bytes: int,
                 security: ClientSecurity = ClientSecurity(), overlap: bool = False,
                 push_during_backward: bool = False, retry: RetryPolicy = RetryPolicy(),
                 clip_grad_norm: float | None = None, compress: str | None = None, pipeline: bool = False,
                 join: bool = False, push_window: int = 1, refused_timeout: float = LOOPBACK_REFUSED_SECONDS):
        self.tables = sharded_tables(model)  # bound to the shards once joined (_bind_tables)
        check_variants(job, bool(self.tables), overlap, pipeline)
        check_window(job, push_window, overlap=overlap, pipeline=pipeline, push_during_backward=push_during_backward,
                     compress=compress)
        self.clip_grad_norm = check_max_norm(clip_grad_norm, push_during_backward)
        self.model, self.job, self.overlap = model, job, overlap
        self.forward_module = model  # what the training loop calls forward on
        self.round_timeout, self.connect_timeout = round_timeout, connect_timeout
        self.layout = model_layout(model, job.num_shards)
        self.num_params = self.layout.total
        self.describe = describe(job)
        self.flat = FlatModel(model)
        self.client = ShardedClient(addresses, job, rank, trainer_id, chunk_bytes=chunk_bytes, security=security,
                                    retry=retry, compress=compress)
        # Slots: every partition of every shard (job.partitions per shard; one when unpartitioned), in the flat
        # vector's order.  The dense exchange is per slot; tables and tools talk to shards.
        self.slots = DenseSlots(job, self.flat, self.client, self.num_params)
        self.num_parts, self.ranges, self.versions = self.slots.num_parts, self.slots.ranges, self.slots.versions
        self.staging = self.slots.staging
        prefetch = Prefetcher(self.slots, round_timeout) if overlap else None
        self.session = Session(self.slots, rank, connect_timeout,
                               refused_timeout if on_loopback(addresses) else None,
                               prefetch.discard if overlap else lambda slot: None)
        self.membership = Membership(self.client, job.num_trainers, sync=job.mode == "sync")
        self._early = EarlyPusher(self.flat.params, self.flat.grad_views, self.flat.ranges, self.ranges,
                                  self.slots.push, self.staging.produced if self.staging.active else None
                                  ) if push_during_backward else None
        # pipeline: step() hands the dense exchange to a thread; each module's forward waits for its own slots
        self._waits = LayerWaits(model, {id(p): r for p, r in zip(self.flat.params, self.flat.ranges)},
                                 self.ranges, self.staging.settle) if pipeline else None
        self.exchange = DenseExchange(self.slots, self.session, round_timeout, self.clip_grad_norm,
                                      prefetch, self._early, self._waits)
        self.pipelined = PipelinedExchange(self.exchange, self._waits, self._early) if pipeline else None
        # push_window > 1: async steps return before their push is acknowledged (trainer.stepping.windowed)
        # (a sync job whose tables are async windows those only: trainer.tables.table_window, bound in _bind_tables)
        self.windowed = WindowedExchange(self.slots, self.session, push_window, round_timeout,
                                         self.clip_grad_norm) if push_window > 1 and job.mode == Mode.ASYNC else None
        self.push_window = push_window
        self.table_push = TablePush(self.tables, self.client, lambda: self.session.rank)
        self.step_call = StepCall(self.exchange, self.table_push, lambda: self.rows)  # trainer.stepping.step_call
        # a live re-shard: the slots follow a later layout at a step boundary (trainer.membership.relayout)
        self.relayout = Relayout(self.slots, self.session, self._relaid, unsupported=", ".join(
            name for name, on in (("overlap", overlap), ("pipeline", pipeline), ("push_during_backward",
                                  push_during_backward), ("async tables", has_async_tables(job))) if on),
            rows=lambda: self.rows)
        self.runner = StepRunner(self.exchange, self.table_push, self.session, self.flat, self.client.count,
                                 self.windowed, self.pipelined, self._early, prefetch, self.step_call, self.relayout)
        self.rows = None
        self._closed = False
        self.joined_at = 0  # the round this trainer's first step computes (a join: the round it was admitted at)
        try:
            self.session.join(connect_timeout, running=join, follow=self.relayout.at_register)
            self.joined_at = self.versions[0] if join else 0
            self._bind_tables()
        except BaseException as e:
            # Leave and close, or this trainer would stay registered (and, with heartbeats, live): sync
            # rounds would wait on it.  The error carries what the shards answered: the caller holds no
            # trainer to ask (ps-trainer's SIGTERM while connecting reports it).
            self.close(leave=True, best_effort=True)
            e.left, e.leave_outcome = self.left, self.leave_outcome()
            raise
        log.info("rank %d connected to %d shards at versions %s", rank, job.num_shards, self.versions)

    def _relaid(self) -> None:
        """The slots followed a later layout (trainer.membership.relayout): what this facade shows of them."""
        self.job, self.num_parts, self.staging = self.client.job, self.slots.num_parts, self.slots.staging
        self.step_call.relaid()  # its Step stubs over the new shards' channels
        self.layout = model_layout(self.model, self.job.num_shards)
        self.describe = describe(self.job)

    def _bind_tables(self) -> None:
        """Point the model's tables at their rows on the shards."""
        if not self.tables:
            return
        self.rows = sharded_rows_class()(self.client, self.job, on_restart=self.session.rejoin_for_tables)
        self.session.track_rows(self.rows, self.joined_at)
        if self.push_window > 1:
            self.rows.use_window(self.push_window)
        for t in self.tables:
            t.bind(self.rows)

    @property
    def rank(self) -> int:
        """This trainer's rank (a join: the one the job handed out)."""
        return self.session.rank

    @property
    def steps(self) -> int:
        """Dense steps completed (windowed: handed to the window)."""
        return self.runner.steps

    @property
    def timeline(self) -> list[Epoch]:
        """The job's membership epochs, as far as this trainer needs them (docs/elastic.md)."""
        return self.membership.timeline

    def members_at(self, round_: int) -> list[int]:
        """The ranks of the job's membership epoch at ``round_``, sorted (docs/elastic.md)."""
        return self.membership.members_at(round_)

    def fetch_timeline(self, part=None) -> list[Epoch]:
        """The job's membership timeline as ``part`` (default: partition 0 of shard 0) knows it now."""
        return self.membership.fetch_timeline(part)

    def announce_leave(self) -> None:
        """Say with the next push that it is this trainer's last (docs/elastic.md): the shards take it out of
        the membership from the round after that one, before serving it, so the others split that round's data
        without it.  Then ``leave()``.  (``leave()`` alone takes effect from the round open when it arrives,
        whose data the others may already have split with this trainer in.)"""
        self.membership.announce_leave()

    def leave(self) -> None:
        """Leave the job now, at a step boundary (rounds from the next on expect one fewer) and close."""
        self.close(leave=True)

    @property
    def left(self) -> bool:
        """Every shard that knew this trainer was told it left."""
        return self.session.left

    @property
    def leave_answers(self) -> dict[int, str]:
        """slot -> LEFT, NOT_LISTED or the error its Leave got."""
        return self.session.leave_answers

    def prepare_step(self, num_samples: int) -> None:
        """Announce that the next backward is the last before step(), on ``num_samples`` samples.

        With ``push_during_backward`` this lets each shard's push start as soon as
        backward has produced its slice; without it (or if never called) it does nothing.
        """
        self.runner.prepare(num_samples)

    def step(self, num_samples: int = 1) -> StepInfo:
        """Push the gradients in ``.grad`` and the tables' gradient rows, pull fresh weights into the model,
        zero the gradients.

        All or nothing from the caller's view: if a shard fails, StepFailed names
        the shards that applied the gradient, the gradients stay, and calling
        ``step()`` again retries only the rest, under the same sequence numbers.
        A table push that fails raises its grpc.RpcError; the retry pushes only
        the tables (and shards) not done, then the dense step (trainer.stepping.step).
        """
        return self.runner.step(num_samples)

    def prefetch(self, ids: dict, ahead: int = 1) -> None:
        """Announce the ids ({table name: ids}) the forward of the batch after the current one will look up:
        their rows are pulled in the background (trainer.tables.row_prefetch) -- a sync table's once this step's
        push is answered, at the version it leads to (exact); an async table's at once.  ``ahead=0``: the
        current batch's, before its forward.  Ids not announced are pulled by the forward as before."""
        if self.rows is None:
            return
        self.table_push.push_beside()  # see trainer.stepping.table_push
        for name, table_ids in ids.items():
            self.rows.prefetch(name, table_ids, ahead)

    def prefetching(self, batches, ids_of=None, forward=None):
        """``batches`` (any iterable: a DataLoader, a list) with each batch's rows prefetched one batch ahead.

        ``ids_of(batch) -> {table name: ids}`` says which ids a batch looks up; without it they are found by
        running ``forward(model, batch)`` (default: ``model(*batch)``) with the tables only recording ids
        (trainer.tables.lookahead)."""
        if self.rows is None:
            return iter(batches)
        return prefetching(self.model, batches, self.prefetch, ids_of, forward)

    def abandon_step(self) -> None:
        """Drop a failed step instead of retrying it: the shards that did not answer may or may not have
        applied it (counted in ``steps_abandoned``); the gradients are zeroed and the next step is a new one."""
        self.runner.abandon()

    def take_forward_wait(self) -> float:
        """Seconds forwards spent waiting for pipelined slots since the last call (0 unpipelined): the training
        loop counts them as waiting for the exchange, not as compute."""
        return self.runner.take_forward_wait()

    def flush(self) -> None:
        """Bring in the weights still being pulled in the background (before evaluating or saving); a
        pipelined exchange's failure is raised here as StepFailed."""
        self.runner.flush()

    def zero_grad(self) -> None:
        self.runner.zero_grad()

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
        self.session.stop_heartbeats()  # before the channels close under them
        try:
            if not best_effort:
                try:
                    self.flush()
                except grpc.RpcError as e:  # leaving matters more than the weights still being pulled
                    log.warning("rank %d: the weights pulled in the background were lost: %s %s", self.rank,
                                e.code().name, e.details())
            if leave:
                self.session.leave(best_effort)
        finally:
            self._closed = True
            if self.rows is not None:
                self.rows.close()
            self.client.close()  # channels first: cancels calls still in flight, so the pools below drain
            self.runner.close()

    def leave_outcome(self) -> str:
        """What closing told the shards, in words that claim no more than their answers (for ps-trainer's last
        line): left, had registered nowhere, or could not leave which shard and why."""
        return self.session.leave_outcome()

    def __enter__(self) -> "ParameterServerTrainer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # After an error, leaving is best effort: a failing Leave must not hide the error that ended the block.
        self.close(best_effort=exc_type is not None)


def check_variants(job: JobSpec, has_tables: bool, overlap: bool, pipeline: bool) -> None:
    """The exchange variants that cannot go together; raises ValueError saying why."""
    if pipeline and has_tables:
        raise ValueError("pipeline with shard-backed embedding tables is not supported: a table's pull in the "
                         "forward and the pipelined exchange could both rejoin a restarted shard at once")
    if pipeline and overlap:
        raise ValueError("pipeline and overlap both hide the pull behind compute: choose one (pipeline waits "
                         "per layer and keeps sync mode exact; overlap computes on weights one push old)")
    if overlap and job.mode != Mode.ASYNC:
        raise ValueError(f"overlap (pulling the next weights while computing) needs async mode, not {job.mode}")


def check_window(job: JobSpec, push_window: int, overlap: bool = False, pipeline: bool = False,
                 push_during_backward: bool = False, compress: str | None = None) -> None:
    """What a push window of ``push_window`` cannot go with; raises ValueError saying why (trainer.stepping.windowed)."""
    if not 1 <= push_window <= MAX_PUSH_WINDOW:
        raise ValueError(f"push_window is {push_window} but must be 1 to {MAX_PUSH_WINDOW} (pushes in flight)")
    if push_window == 1:
        return
    if job.mode != Mode.ASYNC and not any(table_mode(t, job) == Mode.ASYNC for t in job.tables):
        raise ValueError(f"push_window {push_window} needs mode async (or async tables), not {job.mode}: a sync "
                         f"round waits for every trainer's push, so a second one in flight could only wait for "
                         f"the next round")
    clash = [n for n, on in (("overlap", overlap), ("pipeline", pipeline),
                             ("push_during_backward", push_during_backward), ("compress", compress)) if on]
    if clash:
        raise ValueError(f"push_window {push_window} does not go with {clash[0]}: the window already keeps the "
                         f"pushes off the step's path (use push_window=1 with {clash[0]})")
    if job.max_staleness is not None and push_window > job.max_staleness + 1:
        raise ValueError(f"push_window is {push_window} but max_staleness is {job.max_staleness}: this trainer's "
                         f"own pushes in flight make a push up to {push_window - 1} versions stale, so the window "
                         f"must be at most max_staleness + 1 = {job.max_staleness + 1}")


def describe(job: JobSpec) -> str:
    """The few words the training loop's start line says of the job."""
    return f"{job.num_shards} shards, mode {job.mode}" + (
        f", {job.partitions} partitions each" if job.partitions > 1 else "") + (
        f", {len(job.tables)} sparse tables" if job.tables else "")


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
            pipeline: bool = False, join: bool = False, max_trainers: int = 0,
            lr_scaling: str = "none", push_window: int = 1,
            refused_timeout: float = LOOPBACK_REFUSED_SECONDS) -> ParameterServerTrainer:
    """Register ``model`` with the shards at ``ps`` and return a handle whose ``step()`` trains it.

    ``rank`` and ``num_trainers`` not given are read from ``RANK`` and ``WORLD_SIZE``
    as torchrun sets them (else 0 and 1; trainer.membership.torchrun).
    Rank 0 initialises the shards with its model's weights; every trainer then
    starts from the shards' weights.  Raises ValueError for a bad setting and
    grpc.RpcError (FAILED_PRECONDITION, with the difference named) when the
    shards run a different job.  ``security`` carries TLS files and the token
    (see psserver.protocol.security).  ``overlap`` (async mode only) pulls the next
    weights in the background while the next gradient is computed.
    ``push_during_backward`` (any mode) starts each shard's push as soon as
    backward has produced its slice; call ``prepare_step(num_samples)`` before
    ``loss.backward()`` (see trainer.stepping.early_push).  ``job_id`` names this run: while
    a job runs, shards refuse trainers of another id (FAILED_PRECONDITION naming
    both); once every trainer of a job has left, the next job starts fresh.
    ``retry_budget``: seconds one call is retried after UNAVAILABLE (a shard
    restarting) before ``step()`` raises StepFailed.  ``refused_timeout``: where every
    address is on loopback, connecting gives up once they refused connections this
    many seconds in a row (a wrong port), before ``connect_timeout``.  Use it as a context
    manager (``with connect(...) as ps:``) to leave the job on every way out.
    ``lr_schedule`` (an LrSchedule or its fields as a dict) is applied by the
    shards from their version; ``clip_grad_norm`` clips this trainer's own
    gradient to that 2-norm before each push (trainer.stepping.clipping).  ``compress="topk:RATIO"`` pushes each
    shard only the largest RATIO of its slice, keeping the rest for later pushes (trainer.channels.compress).

    Partitions: ``partition_bytes=N`` cuts each shard's slice into pieces of at most N bytes, each with its
    own round on the shard (psserver.partition.host), pushed and pulled on its own (every trainer of a job must agree);
    ``partitions=K`` asks for K per shard instead.
    ``pipeline=True`` returns from ``step()`` while the exchange goes on: each module's next forward waits
    only for the partitions holding its parameters (trainer.stepping.pipeline); ``step()`` then returns the previous
    step's StepInfo.  In sync mode both leave the parameters bit-identical to the plain exchange.
    ``push_window=W`` (async only): ``step()`` returns once at most W-1 of this trainer's pushes are
    unacknowledged (trainer.stepping.windowed); ``flush()`` and ``close()`` wait for all of them.

    Elastic jobs (docs/elastic.md): ``max_trainers=K`` lets trainers join the running job up to K members;
    ``join=True`` joins one (``rank`` is ignored: the job hands one out, ``ps.rank`` after connecting) from
    the next round every shard agrees on; ``ps.leave()`` leaves at a step boundary.  ``lr_scaling="linear"``
    scales the rate with the members of each round.

    Tables: the model's ShardedEmbedding / ShardedEmbeddingBag modules (trainer.tables.embedding)
    join the job as its sparse tables (sorted by name) and are bound to their rows on
    the shards; ``step()`` pushes their gradient rows too.  ``embedding_mode="async"``
    runs every table that names no mode itself asynchronously next to the dense
    layers' ``mode`` (the usual recommender recipe).
    """
    if retry_budget < 0:
        raise ValueError(f"retry_budget is {retry_budget} but must be zero or more seconds")
    if not refused_timeout > 0:
        raise ValueError(f"refused_timeout is {refused_timeout} but must be more than zero seconds")
    rank, num_trainers = rank_and_world(0 if join else rank, num_trainers)
    parse_compress(compress)  # a bad value is refused before anything starts
    addresses = parse_addresses(ps)
    job = make_job(model, len(addresses), mode=mode, num_trainers=num_trainers, optimizer=optimizer,
                   max_staleness=max_staleness, sync_timeout=sync_timeout,
                   replicas_to_aggregate=replicas_to_aggregate, stale_policy=stale_policy, wire_dtype=wire_dtype,
                   job_id=job_id, lr_schedule=lr_schedule, embedding_mode=embedding_mode,
                   partition_bytes=partition_bytes, partitions=partitions, max_trainers=max_trainers,
                   lr_scaling=lr_scaling)
    trainer_id = trainer_id or (default_trainer_id(rank) if not join else default_trainer_id(-1).replace("rank-1", "join"))
    return ParameterServerTrainer(addresses, model, job, rank, trainer_id,
                                  connect_timeout, round_timeout, chunk_bytes, security or ClientSecurity(), overlap,
                                  push_during_backward, RetryPolicy(budget_seconds=retry_budget),
                                  clip_grad_norm=clip_grad_norm, compress=compress, pipeline=pipeline, join=join,
                                  push_window=push_window, refused_timeout=refused_timeout)
