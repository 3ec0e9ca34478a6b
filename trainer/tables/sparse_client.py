"""The trainer's side of sparse tables: PullRows and PushRows fanned out to the shards that hold the rows.

``ShardedRows`` rides on a ``trainer.channels.client.ShardedClient``: its channels, identity,
retry policy, thread pool and counters.  Ids are split by ``shard_of`` (the same
splitmix64 placement the shards check); every shard gets one call per pull (if it
holds any of the ids) and one per push (always, possibly of no ids, so sync rounds
close and Adam's per-table step count matches one process).

Versions: each (shard, table) has its own version.  A push's base is the version of
this trainer's latest pull of that table from that shard (or what the shard said
after the last push).  In sync and stale-timeout modes a pull waits for the version
after this trainer's last push to that table on that shard -- the round it was in
closed; in async mode it waits for nothing.

Where it lives: this module splits ids and fans calls out; one call to one shard is trainer.tables.row_calls; the
lanes' versions, numbering and kept pushes are trainer.tables.row_lanes (numbering: trainer.channels.push_numbers, shared
with the dense slices); async tables' windows are trainer.tables.table_window.

Why ``ShardedRows`` is ~370 lines: it is the one object the embeddings, the prefetch, the row cache, the
table window and the Step call (trainer.stepping.step_call: ``begin_push``/``part_request``/``part_answered``/
``end_push``) all hold, so its public surface is wide; each method is a few lines that split ids and hand on
to a lane, a call or the cache.  The pull path (``pull`` .. ``_pull_piece``) is the next to move into a room of
its own.

Exactly once: each (shard, table) numbers its pushes from 1; a push whose reply was
lost (UNAVAILABLE, DEADLINE_EXCEEDED) is retried with the same number and the shard
answers DUPLICATE instead of applying it twice.  A push that failed for good on some
shards raises ``RowsPushFailed`` and keeps the gradients: calling ``push`` again for
that table resends them to the unfinished shards only, under the same numbers;
``abandon(table)`` drops them instead, and the next push gets new numbers (a shard
that did apply the dropped one must not answer DUPLICATE to a new gradient).

Shard restarts: a pull answered a version older than one seen before counts the
versions the restored shard lost (async tables go on from it as they are); a row
call answered NOT_FOUND, FAILED_PRECONDITION or OUT_OF_RANGE
(trainer.channels.client.restarted; a pull waiting past what a restored shard can
reach is refused OUT_OF_RANGE too) hands the shard to ``on_restart`` -- the trainer
registers again there and calls ``resync`` with the tables' versions read from the
shard.  Every lane of that shard then goes on from those versions under new
numbers; the push that found the restart, and any failed push still kept for that
shard, are dropped and counted (``pushes_lost``), as are the versions the shard
rolled back (``versions_lost``).  A pull that found it is made again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
import torch

from psserver.protocol.codec import DEFAULT_CHUNK_BYTES
from psserver.protocol.job import JobSpec, table_mode
from psserver.protocol.limits import MAX_ROWS_REPLY_BYTES
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows import idpack
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rows.wire import row_chunks
from psserver.protocol.rules import STALE, Mode, refused_pull_ref, stale_version
from trainer.channels.client import ShardClient, ShardedClient, restarted
from trainer.tables.row_cache import RowCache, pull_through
from trainer.tables.row_calls import RowCalls
from trainer.tables.row_errors import RowsCallFailed, RowsPushFailed
from trainer.tables.row_lanes import Lane, Pending, RowLanes
from trainer.tables.row_prefetch import Claim, RowPrefetch

log = logging.getLogger(__name__)


@dataclass
class PushPlan:
    """A table's push of one step: its payloads by shard, the shards still to do, the rows it pulls back."""

    table: str
    pending: Pending
    todo: list[int]
    claim: Claim | None


@dataclass
class RowsPart:
    """One shard's push of a table, numbered and encoded: its chunks, and what its answer is taken into."""

    table: str
    lane: Lane
    header: _pb.RowsHeader
    pull_ids: torch.Tensor | None
    claim: Claim | None
    num_ids: int
    dim: int
    chunks: list
    windowed: bool = False  # a push window's (trainer.tables.table_window): answered on its thread, base left alone
    ids: torch.Tensor | None = None  # the push's ids and rows, kept to resend them with their ids when the shard
    grads: torch.Tensor | None = None  # refuses the pulls it names (ids once)
    id_bytes: int = 0  # bytes of ids (or pull references) the push sends


class ShardedRows:
    """Sparse tables of ``job`` over the shards of ``sharded_client``."""

    def __init__(self, sharded_client: ShardedClient, job: JobSpec, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 on_restart: Callable | None = None):
        self.client, self.job, self.chunk_bytes = sharded_client, job, chunk_bytes
        self.tables: dict[str, TableSpec] = {t.name: t for t in job.tables}
        self.modes = {t.name: table_mode(t, job) for t in job.tables}
        m = len(sharded_client.shards)
        self.counters: Counter = Counter()
        self._lock = threading.Lock()  # of ``counters``, which the lanes' book counts into too
        self.book = RowLanes(self.modes, m, self.counters, self._lock)  # versions, numbering, kept pushes
        # Called as on_restart(shard_client, error) when a row call finds the shard restarted; it must register
        # again and call resync().  None: the error is raised (nothing here can register).
        self.on_restart = on_restart
        self.caches: dict[str, RowCache] = {}  # tables with a worker-side row cache (use_cache)
        self.window = None  # async tables' push window (use_window; trainer.tables.table_window)
        self._answer_lock = threading.Lock()  # windowed answers of one lane come on several threads
        self.calls = RowCalls(sharded_client.shards, self.count)  # one row call to one shard, retried
        # A sync table's push carries the next batch's prefetched ids and its reply their rows (PushPullRows):
        # one round trip instead of a push and a pull.  False: PushRows, then the prefetch's own PullRows.
        self.fuse = True
        # A push names the pulls its rows were read at instead of resending their ids (ids once; the shard
        # remembers them, psserver.sparse.pull_refs).  False: every push sends its ids.
        self.name_pulls = True
        # The next batches' rows, pulled ahead (trainer.tables.row_prefetch); used by pull(), moved on by push().
        self.ahead = RowPrefetch({n: t.dim for n, t in self.tables.items()},
                                 {n: m != Mode.ASYNC for n, m in self.modes.items()}, m, self.split,
                                 self._fetch_ahead, self._adopt, self.count)

    @property
    def _lanes(self) -> dict:
        """(shard, table) -> its Lane (trainer.tables.row_lanes); read by tests and the accounting soak."""
        return self.book.lanes

    @property
    def _pending(self) -> dict:
        """table -> its failed push kept for the retry (trainer.tables.row_lanes.Pending)."""
        return self.book.pending

    def count(self, **amounts: int) -> None:
        with self._lock:
            self.counters.update(amounts)

    def _spec(self, table: str) -> TableSpec:
        spec = self.tables.get(table)
        if spec is None:
            raise KeyError(f"table {table!r} is not in the job (its tables: {', '.join(self.tables) or 'none'})")
        return spec

    def split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each shard, the positions in ``ids`` of the ids it holds."""
        owner = shard_of(ids, len(self.client.shards))
        return [(owner == s).nonzero().flatten() for s in range(len(self.client.shards))]

    # -- the row cache (trainer.tables.row_cache) -------------------------------------------------------------
    def use_cache(self, table: str, rows: int, max_staleness: int = 0) -> None:
        """Cache up to ``rows`` of ``table``'s rows here, served while at most ``max_staleness`` versions old."""
        self.caches[table] = RowCache(rows, self._spec(table).dim, max_staleness,
                                      count=lambda **n: self.count(**{f"cache_{k}": v for k, v in n.items()}))

    def known_versions(self, table: str) -> torch.Tensor:
        """Per shard, the newest version of ``table`` this trainer knows of (RowLanes.known_versions), plus its
        own pushes still in flight there (trainer.tables.table_window): a cached row ages by them too."""
        known = self.book.known_versions(table)
        if self.window is not None and table in self.window.windows:
            known = [k + n for k, n in zip(known, self.window.in_flight_of(table))]
        return torch.tensor(known)

    def use_window(self, size: int) -> None:
        """Async tables' pushes: up to ``size`` each in flight, acknowledged in the background
        (trainer.tables.table_window); sync tables are pushed as before."""
        from trainer.tables.table_window import TableWindows
        self.window = TableWindows(self, [n for n, m in self.modes.items() if m == Mode.ASYNC], size)

    def flush(self) -> None:
        """Wait for every table push in flight (RowsPushFailed if some failed for good: flush again retries)."""
        if self.window is not None:
            self.window.flush()

    def window_failed(self, table: str) -> bool:
        """A windowed push of ``table`` failed for good and waits to be retried (or abandoned)."""
        return self.window is not None and self.window.failed(table)

    def _pull_cached(self, table: str, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        cache = self.caches[table]
        owner = shard_of(ids, len(self.client.shards))
        out, look = pull_through(cache, ids, owner, self.known_versions(table),
                                 lambda miss: self._pull_rows(table, spec, miss))
        if self.modes[table] == Mode.ASYNC and bool(look.hit.any()):
            # the push's base is the oldest version this forward read from each shard: staleness not understated
            hit_owner = owner[look.hit]
            for s in hit_owner.unique().tolist():
                lane = self.book.lanes[(s, table)]
                lane.base = min(lane.base, int(look.versions[hit_owner == s].min()))
        return out

    # -- pull ---------------------------------------------------------------------------------------
    def pull(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``(len(ids), dim)`` of unique int64 CPU ``ids``, in their order, from the shards in
        parallel; in sync modes each shard's at the version after this trainer's last push there.  A table
        with a row cache serves the rows it holds within its bound and pulls only the others."""
        spec = self._spec(table)
        if table in self.caches:
            return self._pull_cached(table, spec, ids)
        return self._pull_rows(table, spec, ids)[0]

    def _pull_rows(self, table: str, spec: TableSpec, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, the version each was read at): prefetched where announced, pulled now otherwise."""
        ahead = self.ahead.take(table, ids, with_versions=True)
        if ahead is not None:  # rows prefetched for this step: pull only the others
            out, known, versions = ahead
            if not bool(known.all()):
                missing = ~known
                out[missing], versions[missing] = self._pull_now(table, spec, ids[missing])
            return out, versions
        return self._pull_now(table, spec, ids)

    def _pull_now(self, table: str, spec: TableSpec, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.split(ids)
        out = torch.empty(len(ids), spec.dim)
        versions = torch.zeros(len(ids), dtype=torch.int64)

        def one(s: ShardClient):
            pos = parts[s.index]
            if len(pos):
                out[pos], versions[pos] = self._pull_shard(s, table, spec.dim, ids[pos])

        results = self.client.map_settled(one)
        failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
        if failed:
            raise RowsCallFailed(table, [i for i in range(len(results)) if i not in failed], failed,
                                 [s.address for s in self.client.shards])
        return out, versions

    def _pull_shard(self, s: ShardClient, table: str, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One shard's rows; a shard found restarted is rejoined (on_restart) and asked again."""
        try:
            return self._pull_once(s, table, dim, ids)
        except grpc.RpcError as e:
            if not self._restarted(s, e):
                raise
        return self._pull_once(s, table, dim, ids)

    def _pull_once(self, s: ShardClient, table: str, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows, version = self._fetch(s, table, dim, ids)
        self._adopt(s.index, table, version)
        return rows, version

    def _fetch_ahead(self, shard: int, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A prefetch's pull (trainer.tables.row_prefetch): rows and version, the push's base left alone."""
        return self._fetch(self.client.shards[shard], table, self.tables[table].dim, ids)

    def _adopt(self, shard: int, table: str, version: int) -> None:
        """Rows read at ``version`` are used by this step's forward: its push's base."""
        self.book.lanes[(shard, table)].base = version

    def _fetch(self, s: ShardClient, table: str, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One shard's rows and the table version they reflect (sync: after this trainer's last push), in calls
        of at most MAX_ROWS_REPLY_BYTES of rows each (the shard refuses a bigger reply); the version is then the
        oldest of the calls' (a push's base: staleness is not understated)."""
        lane = self.book.lanes[(s.index, table)]
        per_call = max(1, MAX_ROWS_REPLY_BYTES // (dim * 4))
        seen = lane.version  # (pushes answered while the pull is out move it on: no going back, RowLanes.pulled)
        pieces = [self._pull_piece(s, table, lane, ids[i:i + per_call]) for i in range(0, len(ids), per_call)]
        version, raw = min(p[0] for p in pieces), b"".join(p[1] for p in pieces)
        if len(raw) != len(ids) * dim * 4:
            raise ValueError(f"shard {s.index} sent {len(raw)} bytes of rows for {len(ids)} ids of dim {dim}")
        for i, (_, _, ref, _) in zip(range(0, len(ids), per_call), pieces):
            lane.refs.record(ref, ids[i:i + per_call])  # (ids once: the push names this pull)
        went_back = self.book.pulled(s.index, table, version, seen, bytes_pulled=len(raw) + sum(p[3] for p in pieces),
                                     rows_pulled=len(ids), row_pull_calls=len(pieces))
        if went_back and table in self.caches:  # rows cached before the restore are of a state that is gone
            self.caches[table].drop_shard(s.index)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).view(len(ids), dim), version

    def _pull_piece(self, s: ShardClient, table: str, lane: Lane, ids: torch.Tensor) -> tuple[int, bytes, int, int]:
        """One PullRows call (sync: at the close of this trainer's last push's round): RowCalls.pull's answer."""
        return self.calls.pull(s, table, lane.wait_for if self.modes[table] != Mode.ASYNC else 0, ids)

    # -- push ---------------------------------------------------------------------------------------
    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> None:
        """Summed gradient rows of unique ``ids`` to every shard (those holding none of them get an empty push).

        Raises:
            RowsPushFailed: some shard failed for good; the gradients are kept and the next ``push`` of this
                table retries the unfinished shards with them (its own arguments are then not read).
        """
        # async: handed over, the step goes on -- unless a push of the table failed outside the window (a Step
        # call's part, trainer.stepping.step_call): that one is sent again first, under its numbers, to the shards that did
        # not answer it (the window would number it anew and every shard would apply it, the answered ones twice)
        if self.window is not None and table in self.window.windows and table not in self.book.pending:
            return self.window.push(table, self._spec(table), ids, grads, num_samples)
        plan = self.begin_push(table, ids, grads, num_samples)
        try:
            results = self.client.map_settled(
                lambda s: self._push_shard(s, table, *plan.pending.payloads[s.index],
                                           *((plan.claim,) if plan.claim else ())), plan.todo)
        finally:
            self.unclaim_rest(plan)
        self.end_push(plan, results)

    def begin_push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> PushPlan:
        """A push's payloads by shard (a failed push's kept ones), the shards still to do, and the next batch's
        rows it asks for (a sync table's claim, trainer.tables.row_prefetch)."""
        spec = self._spec(table)
        pending = self.book.pending.get(table)
        if pending is None:
            self.book.fresh_push(table)
            if grads.shape != (len(ids), spec.dim):
                raise ValueError(f"grads has shape {tuple(grads.shape)}, table {table!r} needs "
                                 f"({len(ids)}, {spec.dim})")
            grads = grads.detach().to("cpu", torch.float32)
            parts = self.ahead.parts_of(table, ids)  # ids once: split when announced, if these are that batch's
            pending = Pending({s: (ids[pos], grads[pos], num_samples)
                               for s, pos in enumerate(self.split(ids) if parts is None else parts)})
        todo = [s for s in pending.payloads if s not in pending.done]
        claim = self.ahead.claim(table) if self.fuse else None
        for shard, pull_ids in (list(claim.ids.items()) if claim else ()):
            if len(pull_ids) * spec.dim * 4 > MAX_ROWS_REPLY_BYTES:  # past one reply's cap: pulled in pieces
                self.ahead.unclaim(claim, shard)
                del claim.ids[shard], claim.futures[shard]
        return PushPlan(table, pending, todo, claim)

    def unclaim_rest(self, plan: PushPlan) -> None:
        """The claimed shards whose push brought no rows back: their rows are pulled as without the fused call."""
        claim = plan.claim
        for shard, fut in (claim.futures.items() if claim else ()):
            if not fut.done():
                self.ahead.unclaim(claim, shard)

    def end_push(self, plan: PushPlan, results: list) -> None:
        """Each shard's result of ``plan.todo`` (an outcome or the Exception): RowsPushFailed keeps the push for a
        retry of the shards not done; done, the prefetches and the row cache move on."""
        table, pending = plan.table, plan.pending
        failed = {s: r for s, r in zip(plan.todo, results) if isinstance(r, Exception)}
        pending.done.extend(s for s in plan.todo if s not in failed and s not in pending.done)
        if failed:
            self.book.pending[table] = pending
            raise RowsPushFailed(table, sorted(pending.done), failed, [s.address for s in self.client.shards])
        self.book.pending.pop(table, None)
        self.ahead.pushed(table)
        if table in self.caches:
            self.caches[table].pushed(torch.cat([p[0] for p in pending.payloads.values()]))

    def _push_shard(self, s: ShardClient, table: str, ids: torch.Tensor, grads: torch.Tensor,
                    num_samples: int, claim: Claim | None = None) -> str:
        """One shard's push (with ``claim``'s ids of this shard, a PushPullRows delivering their rows); on a
        shard found restarted it is dropped ("lost") once the shard is rejoined."""
        try:
            return self.push_once(s, self.part(s, table, ids, grads, num_samples, claim))
        except grpc.RpcError as e:
            if not self._restarted(s, e):
                raise
        self.book.count_lost(s.index, table)
        return "lost"

    def push_alone(self, s: ShardClient, plan: PushPlan) -> str:
        """Shard ``s``'s push of ``plan`` as a call of its own, without the claimed rows (a Step that found the
        shard restarted, trainer.stepping.step_call)."""
        return self._push_shard(s, plan.table, *plan.pending.payloads[s.index])

    def part_request(self, s: ShardClient, plan: PushPlan) -> RowsPart:
        """Shard ``s``'s push of ``plan`` (trainer.stepping.step_call sends it as a part of a Step call)."""
        return self.part(s, plan.table, *plan.pending.payloads[s.index], plan.claim)

    def part(self, s: ShardClient, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int,
              claim: Claim | None, numbered: tuple[int, int] | None = None) -> RowsPart:
        """Shard ``s``'s push under its lane's number (the unanswered one again on a retry): the request's
        chunks, and what its answer needs.  ``numbered``: a windowed push's (sequence, base), fixed when it was
        made (trainer.tables.table_window); its answer leaves the lane's base alone."""
        lane = self.book.lanes[(s.index, table)]
        # the unanswered push's number again (a retried step), else a new one
        sequence, base = numbered if numbered is not None else (lane.number(), lane.base)
        pull_ids = claim.ids.get(s.index) if claim is not None else None
        header = _pb.RowsHeader(rank=s.rank, trainer_id=s.trainer_id, fingerprint=s.fingerprint, table=table,
                                version=base, num_samples=num_samples, sequence=sequence,
                                num_ids=len(ids), dim=grads.shape[1], layout_epoch=s.layout_epoch)
        if pull_ids is not None:
            if idpack.packable(pull_ids):
                header.packed_pull_ids = idpack.pack(pull_ids)
            else:
                header.pull_ids = pull_ids.contiguous().numpy().tobytes()
        named = lane.refs.name(ids) if self.name_pulls and idpack.packable(ids) else None
        if named is not None:  # ids once: the pulls this push's rows were read at, not their ids
            header.pull_refs.extend(named[0])
            header.extra_ids = idpack.pack(named[1])
            id_bytes = len(header.extra_ids) + 10 * len(named[0])
        else:
            id_bytes = 8 * len(ids)
        return RowsPart(table, lane, header, pull_ids, claim, len(ids), grads.shape[1],
                        list(row_chunks(grads, header, self.chunk_bytes, ids if named is None else None, raw=True)),
                        numbered is not None, ids, grads, id_bytes)

    def with_ids(self, part: RowsPart) -> RowsPart:
        """``part`` again -- same number, base and pull -- with its ids instead of the pulls it named: the shard
        holds none of them (refused, reason pull-ref-unknown); counted (``pull_refs_refused``) and logged."""
        part.lane.refs.forget()
        self.count(pull_refs_refused=1)
        log.info("table %r: the shard holds no pull this push named (%s); sent again with its %d ids", part.table,
                 ", ".join(f"{r:#x}" for r in part.header.pull_refs), part.num_ids)
        header = _pb.RowsHeader()
        header.CopyFrom(part.header)
        header.ClearField("pull_refs")
        header.ClearField("extra_ids")
        return RowsPart(part.table, part.lane, header, part.pull_ids, part.claim, part.num_ids, part.dim,
                        list(row_chunks(part.grads, header, self.chunk_bytes, part.ids, raw=True)), part.windowed,
                        part.ids,
                        part.grads, 8 * part.num_ids)

    def push_once(self, s: ShardClient, part: RowsPart) -> str:
        try:
            try:
                reply, pulled, sent = self.calls.push(s, part.chunks, fused=part.pull_ids is not None)
            except grpc.RpcError as e:
                if not (part.header.pull_refs and refused_pull_ref(e)):
                    raise
                part = self.with_ids(part)
                reply, pulled, sent = self.calls.push(s, part.chunks, fused=part.pull_ids is not None)
        except grpc.RpcError as e:
            if self.part_stale(part, e) is None:
                raise
            return STALE
        return self.part_answered(s, part, reply, pulled, sent)

    def part_stale(self, part: RowsPart, e: grpc.RpcError) -> str | None:
        """STALE when ``e`` refused the push as too stale -- answered (dropped): the lane goes on from the
        shard's version -- else None."""
        version = stale_version(e, part.lane.base)
        if version is None:
            return None
        self.book.stale(part.lane, version)
        self.count(stale_pushes=1)
        return STALE

    def part_answered(self, s: ShardClient, part: RowsPart, reply: _pb.PushRowsReply, pulled: tuple | None,
                      attempts: int) -> str:
        """What the shard answered to ``part`` (and the rows it pulled: (version, bytes)), taken into its lane."""
        lane, table = part.lane, part.table
        s.saw_layout(reply.layout_epoch)  # a table-only shard teaches a switch too (trainer.membership.relayout)
        with self._answer_lock if part.windowed else contextlib.nullcontext():  # (a window's answer on its thread)
            outcome = self.book.answered(lane, table, _pb.PushOutcome.Name(reply.outcome).lower(),
                                         part.header.version, reply.version, attempts, windowed=part.windowed)
        self.count(bytes_pushed=part.num_ids * 4 * part.dim + part.id_bytes, rows_pushed=part.num_ids,
                    rows_stale=reply.rows_stale, pushes_naming_pulls=int(bool(part.header.pull_refs)),
                    **{f"{outcome}_pushes": 1})
        rows = (self._rows_read(s, table, lane, part.pull_ids, *pulled,
                                id_bytes=len(part.header.pull_ids) + len(part.header.packed_pull_ids))
                if pulled is not None else None)
        if rows is not None:
            self.ahead.deliver(part.claim, s.index, rows, pulled[0])
        return outcome

    def _rows_read(self, s: ShardClient, table: str, lane: Lane, ids: torch.Tensor, version: int,
                   raw: bytes, ref: int = 0, id_bytes: int | None = None) -> torch.Tensor | None:
        """A fused call's rows (their version is the push's round close: nothing to check against a restore).
        Rows of the wrong size are counted and dropped, not raised: the push was answered, and raising would
        resend its gradient under a new number; the prefetch pulls them again instead."""
        dim = self.tables[table].dim
        if len(raw) != len(ids) * dim * 4:
            self.count(fused_rows_refused=1)
            log.warning("shard %d sent %d bytes of rows for %d ids of dim %d in a PushPullRows reply; pulled "
                        "again", s.index, len(raw), len(ids), dim)
            return None
        lane.refs.record(ref, ids)  # (ids once: the push of these rows names this pull)
        with self._lock:
            lane.version = max(lane.version, version)
            self.counters.update(bytes_pulled=len(raw) + (8 * len(ids) if id_bytes is None else id_bytes),
                                 rows_pulled=len(ids), fused_pulls=1)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).view(len(ids), dim)

    def _push_outcome(self, lane: Lane, outcome: str, attempts: int) -> str:
        """RowLanes.push_outcome (the first DUPLICATE after a resync is a lost push)."""
        return self.book.push_outcome(lane, outcome, attempts)

    # -- faults -------------------------------------------------------------------------------------
    def _restarted(self, s: ShardClient, e: grpc.RpcError) -> bool:
        """Whether ``e`` says the shard restarted and it was rejoined (on_restart, which calls resync)."""
        if not restarted(e) or self.on_restart is None:
            return False
        self.on_restart(s, e)
        return True

    def resync(self, shard: int, versions: dict[str, int]) -> None:
        """Shard ``shard`` restarted and this trainer registered again: every table goes on from ``versions``
        (the shard's, by table; RowLanes.resync), and the rows cached or prefetched from it are dropped."""
        self.book.resync(shard, versions)
        if self.window is not None:
            self.window.resynced(shard)
        for cache in self.caches.values():  # (not under the lock: the caches count through it)
            cache.drop_shard(shard)
        self.ahead.drop()

    def off_round(self, rounds: dict[str, int], taking_back: set[str] = frozenset()) -> str:
        """Why the tables cannot follow a layout whose tables start at ``rounds`` now ('' when they can):
        trainer.membership.relayout refuses the switch by this reason (RowLanes.off_round; an async table's push window).
        ``taking_back``: tables whose kept push every shard refused layout-moved (``take_back``)."""
        if self.window is not None and self.window.windows:
            return f"async tables ({', '.join(sorted(self.window.windows))}) push through a window"
        return self.book.off_round(rounds, taking_back)

    def take_back(self, table: str) -> None:
        """Every shard refused ``table``'s kept push ``layout-moved``: nothing of it was applied anywhere, so it is
        dropped here and the table's rows (kept by the embedding, trainer.tables.embedding) go again in the new layout."""
        self.book.pending.pop(table, None)

    def relaid(self, job: JobSpec, rounds: dict[str, int]) -> None:
        """The client's shards were switched to a later layout (trainer.membership.relayout): ids are split by the new shard
        count from now on (``_split`` reads it), each table's lanes start at its switch round ``rounds``, the row
        calls go over the new shards' channels, and what was read from the old shards is forgotten -- prefetched
        batches, cached rows (counted ``cache_dropped``) and remembered pulls."""
        old = self.book.num_shards
        m = len(self.client.shards)
        self.job = job
        self.book.relaid(m, rounds)
        self.calls = RowCalls(self.client.shards, self.count)
        for cache in self.caches.values():
            for shard in range(old):
                cache.drop_shard(shard)
        self.ahead.relaid(m)
        self.count(tables_relaid=1)
        log.warning("tables %s follow %d shards (was %d) from rounds %s: lanes, row calls and placement rebuilt, "
                    "prefetched and cached rows of the old shards dropped", sorted(self.tables), m, old, rounds)

    def start_at(self, shard: int, versions: dict[str, int]) -> None:
        """A new trainer's lanes of shard ``shard`` go on from the tables' ``versions`` there (nothing lost)."""
        self.book.start_at(shard, versions)

    def abandon(self, table: str) -> bool:
        """Drop ``table``'s failed push instead of retrying it (trainer.stepping.api's abandon_step): the shards that
        did not answer get new numbers (RowLanes.abandon).  Returns whether there was one."""
        self._spec(table)
        if self.window_failed(table):
            self.count(pushes_abandoned=self.window.abandon(table))
            return True
        return self.book.abandon(table)

    # -- the rest -----------------------------------------------------------------------------------
    def versions(self) -> dict[str, list[int]]:
        """Each table's version on each shard, as this trainer last saw it."""
        return self.book.versions()

    def prefetch(self, table: str, ids: torch.Tensor, ahead: int = 1) -> None:
        """Pull ``table``'s rows of ``ids`` ahead for the step ``ahead`` steps from now (trainer.tables.row_prefetch)."""
        self.ahead.announce(table, ids, ahead)

    def step_dropped(self, table: str) -> None:
        """This step's push of ``table`` will not be made (the step was abandoned): its prefetches move on."""
        self.ahead.pushed(table)

    def close(self) -> None:
        """The prefetch (and push window) threads end; the channels belong to the ShardedClient."""
        self.ahead.close()
        if self.window is not None:
            self.window.close()

