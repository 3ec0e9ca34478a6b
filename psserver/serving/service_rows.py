"""The table RPCs' work (PullRows, PushRows, PushPullRows) and the row stream's checks that run on the loop as
chunks arrive: a room of the servicer (psserver.serving.service.ParameterServerService makes one and hands it what it
calls; its handlers call these and map errors).

What is decided about ids, waits and where a call's table work runs lives in psserver/sparse/calls.py; here a
row stream is decoded, bounded and tiled, and the reply encoded.  Step's table parts reuse these halves.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from psserver.common.logsafe import shorten
from psserver.protocol import limits
from psserver.protocol.errors import (
    InvalidRequest,
    StaleGradient,
    TooLarge,
)
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows.errors import WrongShape
from psserver.protocol.rows.wire import row_chunks
from psserver.protocol.rules import reply_version
from psserver.serving.replies import ReplyStream, RequestHolds
from psserver.serving.service_common import (
    _check_header_fields,
    _check_identity,
    _check_pull_bytes,
    _decoded,
    _no_slot,
    _push_reply,
    StreamEndedEarly,
    _StreamReader,
)
from psserver.sparse.calls import RowCalls
from psserver.sparse.serving import RowsPush

log = logging.getLogger("psserver.serving.service")


class RowRpcs:
    """PullRows, PushRows and PushPullRows, and the row halves Step's table parts reuse (``rows_at``,
    ``check_rows_first``, ``read_rows``).  Handed layout 0's partition 0 (``shard``: its tables' row calls are
    ``rows``), the servicer's layouts, runtime, limits, shard-wide count, call slots
    (psserver.serving.call_slots) and request ledger; it owns the row calls of each layout (``rows_at``)."""

    def __init__(self, shard, layouts, runtime, cfg, count, slots, requests):
        self.layouts, self.runtime, self.cfg, self.count = layouts, runtime, cfg, count
        self.slots, self.requests = slots, requests
        self.rows = RowCalls(shard, runtime, cfg.max_pull_wait)  # the row calls' table steps (layout 0's)
        self._rows_by_epoch: dict[int, RowCalls] = {}  # a later layout's (rows_at)

    def rows_at(self, epoch: int) -> RowCalls:
        """The row calls of layout ``epoch``'s tables (its partition 0's), each layout with its own remembered
        pulls: a pull remembered in one layout is never named against another's rows (ids once).  Call it after
        the layout check (``LayoutHost.rows_head``)."""
        if epoch == 0:
            return self.rows
        calls = self._rows_by_epoch.get(epoch)
        if calls is None:
            self.drop_freed_rows()
            calls = self._rows_by_epoch[epoch] = RowCalls(self.layouts.part(epoch, 0), self.runtime,
                                                          self.cfg.max_pull_wait)
        return calls

    def drop_freed_rows(self) -> int:
        """Forget the row calls of the layouts this process no longer holds (RETIRE freed them, or a restore left
        them behind): each keeps remembered pulls and its tables' partition, one more per live re-shard otherwise.
        On the loop, as ``rows_at``; returns how many were dropped."""
        gone = [epoch for epoch in self._rows_by_epoch if not self.layouts.holds(epoch)]
        for epoch in gone:
            del self._rows_by_epoch[epoch]
        return len(gone)

    async def pull_rows(self, request, context: ReplyStream):
        """The rows of unique ids of one table, in request order, once the table reached min_version."""
        request = _decoded(request)
        _check_identity(request)
        head = self.layouts.rows_head(request.layout_epoch, request.table, request.min_version, pull=True)
        calls = self.rows_at(request.layout_epoch)
        head.check_member(request.rank, request.trainer_id, request.fingerprint)
        head.rows.check_row_pull(request.rank, request.min_version)  # before a wait, and before any row is made
        table = head.tables.get(request.table)
        ids = calls.pull_ids(request.ids, request.packed_ids)
        # the reply, before any row exists (and under the cap a trainer splits its pulls by)
        _check_pull_bytes(len(ids), table.spec.dim, min(self.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
        checked = await calls.check_ids(table, ids)  # before waiting: a refusal is not worth a wait
        waited, table, version, rows = await calls.pull(
            table, request.table, request.rank, request.trainer_id, request.fingerprint, request.min_version,
            checked, self.slots.deadline(context), functools.partial(context.hold, ("rows", id(request))))
        header = _pb.RowsHeader(table=request.table, version=version, num_ids=len(ids), dim=table.spec.dim,
                                wait_seconds=waited, layout_epoch=self.layouts.newest)
        if request.remember:  # (ids once: a push may name this pull instead of resending its ids)
            header.pull_ref = calls.remember(request, checked)
        for chunk in row_chunks(rows, header, self.cfg.chunk_bytes, raw=True):
            await context.write(chunk, self.cfg.chunk_bytes)

    async def push_rows(self, request_iterator, context):
        """Summed gradient rows of unique ids for one table (see ps.proto and psserver.sparse.serving)."""
        with self.slots.peer_slot(context), RequestHolds(self.requests, context.peer() or "?") as holds:
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self.slots.deadline(context))
            h, table, first = await self._rows_header(reader)
            r = await self._apply_push(reader, first, h, table, holds=holds)
            return _push_reply(r, self.layouts.newest)

    async def push_pull_rows(self, request_iterator, context: ReplyStream):
        """PushRows, then the rows of the header's ``pull_ids`` at the version the push leads to (PullRows'
        wait, bounds and gather), in one call: a sync step's push and its next batch's prefetch cross the wire
        once.  The pull ids are checked before the push, so a refused call changes nothing."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self.slots.deadline(context))
        h, table, first = await self._rows_header(reader)
        checked = await self._check_pull_ids(h, table)
        await self._push_pull_rows(reader, first, h, table, checked, context)

    async def _check_pull_ids(self, h: _pb.RowsHeader, table):
        """A push-pull's ``pull_ids``, checked before the push (count, reply bytes, repeats, placement)."""
        calls = self.rows_at(h.layout_epoch)
        ids = calls.pull_ids(h.pull_ids, h.packed_pull_ids, "pull_ids")
        _check_pull_bytes(len(ids), table.spec.dim, min(self.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
        return await calls.check_ids(table, ids)

    async def _push_pull_rows(self, reader, first, h: _pb.RowsHeader, table, checked, context,
                              slot: bool = True, read: tuple | None = None, pushed=None) -> None:
        """PushPullRows' work once its header and pull ids are checked (also a Step's table part, ``slot``
        False: the Step holds the rank's slot; ``read``: its rows, read and checked; ``pushed``: their ids'
        CheckedIds)."""
        r = await self._apply_push(reader, first, h, table, slot, read, pushed, context.requests)
        ids, calls = checked.ids, self.rows_at(h.layout_epoch)
        min_version = reply_version(table.mode, r.outcome, h.version, r.version)
        waited, table, version, rows = await calls.pull(
            table, h.table, h.rank, h.trainer_id, h.fingerprint, min_version, checked, self.slots.deadline(context),
            functools.partial(context.hold, ("rows", id(h))))
        self.count("row_push_pulls")
        layout = self.layouts.newest  # (a row reply is not held: docs/design/handoff-io.md, Tables)
        header = _pb.RowsHeader(table=h.table, version=version, num_ids=len(ids), dim=table.spec.dim,
                                wait_seconds=waited, push=_push_reply(r, layout), pull_ref=calls.remember(h, checked),
                                layout_epoch=layout)
        for chunk in row_chunks(rows, header, self.cfg.chunk_bytes, raw=True):
            await context.write(chunk, self.cfg.chunk_bytes)

    # ------------------------------------------------------------------ a step in one call (psserver.serving.step_parts)
    async def _rows_header(self, reader: _StreamReader):
        """A row push's first chunk: who is asking and what they declare, before a byte of the payload is read."""
        first = await reader.next()
        if first is None:  # (what a push its client cancelled before its first chunk reads as: not counted refused)
            raise StreamEndedEarly("the stream is empty: the first chunk must carry a header")
        first = _decoded(first)
        if not first.HasField("header"):
            raise InvalidRequest("the first chunk has no header")
        h = first.header
        table = self.check_rows_first(h)
        # a sync push one round ahead from a trainer in the open round waits for its close (psserver.sparse.calls)
        calls = self.rows_at(h.layout_epoch)
        table = await calls.wait_push_base(table, h.table, h.rank, h.version, reader.deadline)
        return h, table, first

    def check_rows_first(self, h: _pb.RowsHeader):
        """A row push's header: the caller a member, the table known, the declared sizes bounded; the table."""
        _check_header_fields(h)
        head = self.layouts.rows_head(h.layout_epoch, h.table, h.version)  # the layout first, as a dense push
        head.check_member(h.rank, h.trainer_id, h.fingerprint)
        table = head.tables.get(h.table)
        _check_rows_declared(h, table.spec.dim, self.cfg.max_push_bytes)
        return table

    async def _apply_push(self, reader: _StreamReader, first, h: _pb.RowsHeader, table, slot: bool = True,
                         read: tuple | None = None, pushed=None, holds=None):
        """Read the push's rows and hand it to the table's executor (psserver.sparse.serving): its RowsResult.
        ``read``: the (ids, grads) a Step's check already read, ``pushed``: its ids as checked (CheckedIds);
        ``holds``: the call's request holds (RequestHolds)."""
        calls = self.rows_at(h.layout_epoch)
        async with self.slots.rank_slot(h.rank) if slot else _no_slot():
            ids, grads = read if read is not None else await self.read_rows(reader, first, h, holds)
            pushed = pushed or calls.push_checked(h, table, ids)  # (ids once: its pull's check stands)
            push = RowsPush(h.rank, h.trainer_id, h.version, h.num_samples, h.sequence, ids, grads)
            try:
                return await calls.run(table, grads.numel(), calls.shard.push_rows, h.fingerprint, h.table,
                                       push, self.cfg.nonfinite == "refuse", pushed)
            except StaleGradient:
                self.count("row_pushes_stale")
                raise

    async def read_rows(self, reader: _StreamReader, first, h: _pb.RowsHeader,
                         holds=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream's ids and rows, checked chunk by chunk as they arrive (tiling, sizes) and copied; the bytes
        its header declares held in the request ledger (``holds``) before anything is allocated for them."""
        n, dim = h.num_ids, h.dim
        if holds is not None:
            holds.hold(("rows", id(h)), n * (4 * dim + 8))
        # the ids of the pulls the push names (ids once: its layout's), or None: in the chunks
        named = self.rows_at(h.layout_epoch).push_ids(h)
        ids, grads = torch.empty(n, dtype=torch.int64) if named is None else named, torch.empty(n, dim)
        ids_raw, rows_raw = ids.view(torch.uint8).numpy(), grads.view(-1).view(torch.uint8).numpy()
        pos, chunks, chunk = 0, 0, first
        while chunk is not None:
            chunk = _decoded(chunk)
            k = _check_rows_chunk(chunk, chunks, pos, n, dim, self.cfg.min_chunk_bytes, named is not None)
            if named is None:
                ids_raw[pos * 8:(pos + k) * 8] = np.frombuffer(chunk.ids, dtype=np.uint8)
            rows_raw[pos * dim * 4:(pos + k) * dim * 4] = np.frombuffer(chunk.rows, dtype=np.uint8)
            pos, chunks = pos + k, chunks + 1
            chunk = await reader.next()
        if pos != n:  # closed early (refused) or cancelled by its client (counted cancelled: service_common)
            raise StreamEndedEarly(f"the chunks cover ids [0, {pos}) but num_ids is {n}")
        self.count("bytes_in", n * (4 * dim + (8 if named is None else 0)))
        return ids, grads


def _check_rows_declared(h: _pb.RowsHeader, dim: int, max_bytes: int) -> None:
    """Refuse a row push on its header's declared sizes and weight, before anything is allocated for it."""
    limits.check_num_samples(h.num_samples)  # as a dense push's
    if h.dim != dim:
        raise WrongShape(f"dim is {h.dim} but table {shorten(h.table)} has rows of dim {dim}")
    if h.num_ids > limits.MAX_IDS_PER_CALL:
        raise TooLarge(f"num_ids is {h.num_ids}, over the limit of {limits.MAX_IDS_PER_CALL}")
    declared = h.num_ids * (8 + 4 * dim)
    if declared > max_bytes:
        raise TooLarge(f"the stream declares {declared} bytes, over this shard's limit of {max_bytes} bytes")


def _check_rows_chunk(chunk, index: int, pos: int, n: int, dim: int, min_chunk_bytes: int,
                      named: bool = False) -> int:
    """Refuse a chunk that does not continue the tiling of [0, n) with whole rows; its number of ids.
    ``named``: the header names the push's pulls (pull_refs), so the chunk carries rows only."""
    if index and chunk.HasField("header"):
        raise InvalidRequest(f"the chunk at offset {chunk.offset} repeats the header; only the first may")
    if index and pos == n:
        raise InvalidRequest(f"a chunk at offset {chunk.offset} arrived after the stream covered [0, {n})")
    if chunk.offset != pos:
        raise InvalidRequest(f"chunk offset is {chunk.offset} but {pos} was expected: chunks must tile "
                             f"[0, {n}) once, in order")
    if named and (chunk.ids or len(chunk.rows) % (dim * 4)):
        raise InvalidRequest(f"the chunk at offset {chunk.offset} has {len(chunk.ids)} bytes of ids and "
                             f"{len(chunk.rows)} of rows, but the header names pull_refs: rows only, whole rows "
                             f"of dim {dim}")
    if len(chunk.ids) % 8:
        raise InvalidRequest(f"the chunk at offset {chunk.offset} has {len(chunk.ids)} bytes of ids, not a "
                             "multiple of 8 (int64 ids)")
    k = len(chunk.rows) // (dim * 4) if named else len(chunk.ids) // 8
    if pos + k > n:
        raise InvalidRequest(f"the chunk at offset {chunk.offset} holds {k} ids, past the end of [0, {n})")
    if len(chunk.rows) != k * dim * 4:
        raise WrongShape(f"the chunk at offset {chunk.offset} has {len(chunk.rows)} bytes of rows but its {k} ids "
                         f"need {k} x dim {dim} x 4 = {k * dim * 4}")
    if len(chunk.ids) + len(chunk.rows) < min_chunk_bytes and pos + k != n:
        raise InvalidRequest(f"the chunk at offset {chunk.offset} carries {len(chunk.ids) + len(chunk.rows)} bytes, "
                             f"under the minimum of {min_chunk_bytes} for every chunk but the last")
    return k
