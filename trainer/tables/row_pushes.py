"""The push side of a trainer's sparse tables: a table's push of one step, numbered, encoded and settled by shard.

``RowPushes`` serves ``ShardedRows.push`` (trainer.tables.sparse_client) and the Step call's table parts
(trainer.stepping.step_call: ``begin_push``/``part_request``/``part_answered``/``end_push``): every shard gets one
call per push (always, possibly of no ids, so sync rounds close and Adam's per-table step count matches one process).
A sync table's push carries the next batch's prefetched ids and its reply their rows (PushPullRows, ``fuse``); a
push names the pulls its rows were read at instead of resending their ids (``name_pulls``, ids once).

Exactly once: each (shard, table) numbers its pushes from 1 (trainer.tables.row_lanes); a push whose reply was lost is
retried with the same number and the shard answers DUPLICATE.  A push that failed for good on some shards raises
``RowsPushFailed`` and is kept for the retry; a shard found restarted is rejoined (trainer.tables.row_routes) and the
push to it goes again from the versions the shard resumed at.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
import torch

from psserver.protocol.limits import MAX_ROWS_REPLY_BYTES
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows import idpack
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rows.wire import row_chunks
from psserver.protocol.rules import STALE, refused_pull_ref, stale_version
from trainer.channels.client import ShardClient
from trainer.tables.row_cache import RowCache
from trainer.tables.row_errors import RowsPushFailed
from trainer.tables.row_lanes import Lane, Pending, RowLanes
from trainer.tables.row_prefetch import Claim, RowPrefetch
from trainer.tables.row_routes import RowRoutes

log = logging.getLogger("trainer.tables.sparse_client")  # the tables' lines, as before the split


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


class RowPushes:
    """Pushes of the tables over ``routes``, numbered and settled in ``book``.

    ``spec(table)``: the table's spec (KeyError naming the job's tables); ``ahead``: the prefetch whose claimed rows
    a fused push brings back; ``caches``: the tables' row caches; ``count(**n)`` counts under ``lock``, the lock of
    the counters ``book`` counts into (a fused pull's version and counters move under it together)."""

    def __init__(self, routes: RowRoutes, book: RowLanes, spec: Callable[[str], TableSpec], ahead: RowPrefetch,
                 caches: dict[str, RowCache], chunk_bytes: int, count: Callable, lock: threading.Lock):
        self.routes, self.book, self.spec, self.ahead, self.caches = routes, book, spec, ahead, caches
        self.chunk_bytes, self.count, self._lock = chunk_bytes, count, lock
        self._answer_lock = threading.Lock()  # windowed answers of one lane come on several threads
        # A sync table's push carries the next batch's prefetched ids and its reply their rows (PushPullRows):
        # one round trip instead of a push and a pull.  False: PushRows, then the prefetch's own PullRows.
        self.fuse = True
        # A push names the pulls its rows were read at instead of resending their ids (ids once; the shard
        # remembers them, psserver.sparse.pull_refs).  False: every push sends its ids.
        self.name_pulls = True

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> None:
        """ShardedRows.push of a table not pushed through a window: to every shard still to do, side by side."""
        plan = self.begin_push(table, ids, grads, num_samples)
        try:
            results = self.routes.client.map_settled(
                lambda s: self.push_shard(s, table, *plan.pending.payloads[s.index],
                                          *((plan.claim,) if plan.claim else ())), plan.todo)
        finally:
            self.unclaim_rest(plan)
        self.end_push(plan, results)

    def begin_push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> PushPlan:
        """A push's payloads by shard (a failed push's kept ones), the shards still to do, and the next batch's
        rows it asks for (a sync table's claim, trainer.tables.row_prefetch)."""
        spec = self.spec(table)
        pending = self.book.pending.get(table)
        if pending is None:
            self.book.fresh_push(table)
            if grads.shape != (len(ids), spec.dim):
                raise ValueError(f"grads has shape {tuple(grads.shape)}, table {table!r} needs "
                                 f"({len(ids)}, {spec.dim})")
            grads = grads.detach().to("cpu", torch.float32)
            parts = self.ahead.parts_of(table, ids)  # ids once: split when announced, if these are that batch's
            pending = Pending({s: (ids[pos], grads[pos], num_samples)
                               for s, pos in enumerate(self.routes.split(ids) if parts is None else parts)})
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
            raise RowsPushFailed(table, sorted(pending.done), failed, [s.address for s in self.routes.client.shards])
        self.book.pending.pop(table, None)
        self.ahead.pushed(table)
        if table in self.caches:
            self.caches[table].pushed(torch.cat([p[0] for p in pending.payloads.values()]))

    def push_shard(self, s: ShardClient, table: str, ids: torch.Tensor, grads: torch.Tensor,
                   num_samples: int, claim: Claim | None = None) -> str:
        """One shard's push (with ``claim``'s ids of this shard, a PushPullRows delivering their rows); a shard
        found restarted is rejoined and the push goes again, on the versions it resumed at -- as the dense slot's
        does (trainer.stepping.exchange.exchange_slot): dropped, it left this trainer a push behind there of a
        peer whose unanswered push was retried into the restored round, and in sync mode each then waited for
        the other's next part (tests/cluster/test_sparse_faults.py)."""
        try:
            return self.push_once(s, self.part(s, table, ids, grads, num_samples, claim))
        except grpc.RpcError as e:
            if not self.routes.restarted(s, e):
                raise
        self.book.pushed_again(s.index, table)
        return self.push_once(s, self.part(s, table, ids, grads, num_samples, claim))

    def part(self, s: ShardClient, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int,
             claim: Claim | None, numbered: tuple[int, int] | None = None) -> RowsPart:
        """Shard ``s``'s push under its lane's number (the unanswered one again on a retry): the request's
        chunks, and what its answer needs.  ``numbered``: a windowed push's (sequence, base), fixed when it was
        made (trainer.tables.table_window); its answer leaves the lane's base alone."""
        lane = self.book.lanes[(s.index, table)]
        # the unanswered push's number again (a retried step), else a new one
        sequence, base = numbered if numbered is not None else (lane.number(), lane.base)
        pull_ids = claim.ids.get(s.index) if claim is not None else None
        c = s.caller
        header = _pb.RowsHeader(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint, table=table,
                                version=base, num_samples=num_samples, sequence=sequence,
                                num_ids=len(ids), dim=grads.shape[1], layout_epoch=c.layout_epoch)
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
                reply, pulled, sent = self.routes.calls.push(s, part.chunks, fused=part.pull_ids is not None)
            except grpc.RpcError as e:
                if not (part.header.pull_refs and refused_pull_ref(e)):
                    raise
                part = self.with_ids(part)
                reply, pulled, sent = self.routes.calls.push(s, part.chunks, fused=part.pull_ids is not None)
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
        s.calls.saw_layout(reply.layout_epoch)  # a table-only shard teaches a switch too (trainer.membership.relayout)
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
        dim = self.spec(table).dim
        if len(raw) != len(ids) * dim * 4:
            self.count(fused_rows_refused=1)
            log.warning("shard %d sent %d bytes of rows for %d ids of dim %d in a PushPullRows reply; pulled "
                        "again", s.index, len(raw), len(ids), dim)
            return None
        lane.refs.record(ref, ids)  # (ids once: the push of these rows names this pull)
        with self._lock:
            lane.version = max(lane.version, version)
            self.book.counters.update(bytes_pulled=len(raw) + (8 * len(ids) if id_bytes is None else id_bytes),
                                      rows_pulled=len(ids), fused_pulls=1)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).view(len(ids), dim)
