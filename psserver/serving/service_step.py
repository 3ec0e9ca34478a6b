"""The Step RPC's work (Step and StepOnce): a step's dense PushPull and table PushPullRows in one call (see
ps.proto), a room of the servicer (psserver.serving.service.ParameterServerService makes one and hands it what it
calls -- among them its dense and table rooms, whose halves each part reuses; its handlers call these and map errors).

Its envelope (parts, checked as they arrive) is psserver.serving.step_parts; its work on the shard's state, one trip to
the state worker, is psserver.serving.step_trip.  Each part's reply is written by the handler half its own RPC uses --
into the call, or, where the trainer asked for one reply message, into psserver.serving.step_reply's packer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import AsyncExitStack

import torch

from psserver.partition.shard import PushResult, Shard
from psserver.protocol import limits
from psserver.protocol.codec import TORCH_DTYPES, check_stream_header, topk_payload_bytes
from psserver.protocol.errors import InvalidRequest, StaleGradient, StreamTimeout, TooLarge
from psserver.protocol.fastwire import RawRowsChunk
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows.wire import row_chunks
from psserver.protocol.rules import STALE, reply_version
from psserver.protocol.stepwire import StepMessage
from psserver.serving.replies import ReplyStream
from psserver.serving.service_common import (
    StreamEndedEarly,
    _check_header_fields,
    _check_pull_bytes,
    _push_reply,
    _StreamReader,
)
from psserver.serving.step_parts import DENSE, ROWS, StepParts, check_caller
from psserver.serving.step_reply import OneReply
from psserver.serving.step_trip import TablePart, run_trip
from psserver.sparse.serving import RowsPush

log = logging.getLogger("psserver.serving.service")


class StepRpc:
    """The Step RPC: each part checked as it arrives, then one trip, then each part's reply.  Handed the
    servicer's layouts, runtime, limits, shard-wide count, call slots (psserver.serving.call_slots), its dense and
    table rooms (psserver.serving.service_dense, psserver.serving.service_rows), its step engine (or None) and
    the count a one-message reply's packer keeps (``shard_count``, layout 0's partition 0's)."""

    def __init__(self, layouts, runtime, cfg, count, slots, dense, tables, engine, shard_count):
        self.layouts, self.runtime, self.cfg, self.count = layouts, runtime, cfg, count
        self.slots, self.dense, self.tables, self.engine, self.shard_count = \
            slots, dense, tables, engine, shard_count

    async def step(self, request_iterator, context: ReplyStream):
        """A step's dense PushPull and table PushPullRows in one call (see ps.proto).  Every part's header, pull
        ids, row tiling and reply bytes are checked on the loop; then one trip to the state worker checks the
        tables' rows, decides the dense push, pushes the tables and pulls what is ready (psserver.serving.step_trip) --
        so a refusal before the dense push changes nothing -- and the replies stream side by side."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self.slots.deadline(context))
        parts, one_reply = await self._step_parts(reader, context.requests)
        out = OneReply(context, min(limits.ONE_REPLY_BYTES, self.cfg.max_message_bytes // 2),
                       self.shard_count) if one_reply else context  # (psserver.serving.step_reply)
        await self._run_parts(parts, context, out)

    async def step_once(self, request, context: ReplyStream):
        """A Step in one message answered in one message (ps.proto): Step's parts, checks, trip and replies, read
        from one request and packed into one reply -- no stream reads or writes on the loop.  A reply over the
        one-message bound is refused before any part runs (_check_once_reply)."""
        # a caller's steady state: its parts, checked against its step session (psserver.serving.step_engine), or None
        parts = self.engine.checked_parts(request, context) if self.engine is not None else None
        checked = parts is not None
        if not checked:
            parts, _ = await self._step_parts(_Received([request], self.slots.deadline(context)), context.requests)
        out = OneReply(context, self.cfg.max_message_bytes, self.shard_count, may_stream=False)  # bounded before
        await self._run_parts(parts, context, out, once=True, checked=checked)
        if self.engine is not None and not checked:
            self.engine.learn(parts, context.peer_name)
        return out.take() or b""  # (a Step always answers each part: never empty)

    async def _run_parts(self, parts: list, context: ReplyStream, out, once: bool = False, checked: bool = False) -> None:
        """A Step's parts, once read: checked, one trip, each part's reply written to ``out`` (the call, or a
        OneReply); ``once``: the reply must fit one message (StepOnce).  ``checked``: the step engine checked the
        parts' headers against the caller's session, so they are not checked again here -- but after a table part
        that may have waited for its round, when the shard may have changed meanwhile."""
        dense = next((p for p in parts if p.kind == DENSE), None)
        if dense is not None and not checked:
            self.dense.check_push_first(dense.header)
        deadline = self.slots.deadline(context)
        tables = []
        for p in parts:
            if p.kind == ROWS:
                tables.append((p.index, t := await self._step_table(p, deadline, context, checked)))
                checked = checked and not t.waited
        if once:
            self._check_once_reply(dense, [t for _, t in tables])
        self.count("step_calls")
        if once:
            self.count("step_calls_once")
        async with self.slots.rank_slot(parts[0].header.rank):
            pushed = await self._step_trip(dense, [t for _, t in tables], context, checked)
            if once:
                await self._replies_in_turn(pushed, dense, tables, out, deadline)
                return
            for _, t in tables:  # refused first, as StepOnce's: a status after a dense reply begun cannot be sent
                if t.error is not None:
                    raise t.error
            turn = asyncio.Lock()
            runs = [] if dense is None else [self.dense.pull_pushed(*pushed, _PartStream(out, dense.index, turn))]
            runs += [self._step_table_reply(t, _PartStream(out, index, turn), deadline) for index, t in tables]
            await _first_error(runs)
            if isinstance(out, OneReply) and not once:
                await out.flush()

    async def _replies_in_turn(self, pushed, dense, tables: list, out: OneReply, deadline: float) -> None:
        """A StepOnce's parts' replies one after another into its one message: nothing is written before all are
        done, so side by side gains nothing and cost a task a part.  A table part the trip refused is raised
        first, before any part waits, as side by side raised it at its first turn; then the dense reply, then each
        table's (a refusal or a cancel on the way ends the call, as there)."""
        for _, t in tables:
            if t.error is not None:
                raise t.error
        if dense is not None:
            await self.dense.pull_pushed(*pushed, _PartStream(out, dense.index))
        for index, t in tables:
            await self._step_table_reply(t, _PartStream(out, index), deadline)

    def _check_once_reply(self, dense, tables: list[TablePart]) -> None:
        """A StepOnce whose weights and rows would pass the one-message bound: refused before any part runs."""
        limit = min(limits.ONE_REPLY_BYTES, self.cfg.max_message_bytes // 2)
        weights = 0
        if dense is not None:
            h = dense.header
            part = self.layouts.part(h.layout_epoch, h.partition)
            weights = part.slice_length() * TORCH_DTYPES[part.wire_dtype()].itemsize
        rows = sum(len(t.pull_ids) * t.table.spec.dim * 4 for t in tables if t.pull_ids is not None)
        if weights + rows > limit:
            raise TooLarge(f"StepOnce's reply would carry {weights + rows} bytes ({weights} of weights, {rows} of "
                           f"rows), over the one-message limit of {limit} bytes: send it as a Step")

    async def _step_parts(self, reader: _StreamReader, holds) -> tuple[list, bool]:
        """A Step's parts, and whether its first message asked for one reply message.  Each part's header is
        checked as it arrives (a member, one caller, the sizes it declares bounded) and the rest read holding a call
        of part 0's rank: a stranger, a part over its bounds or a stream held open is refused, or counted against
        --max-calls-per-rank, before it is read whole.  Every message is held in the shard's request ledger
        (``holds``) until the call ends: parts are kept until the stream ends, and a client that left Step streams
        open is refused at the next message past a cap (--max-request-bytes-per-peer, --max-request-bytes)."""
        collected = StepParts(self.cfg.max_push_bytes, min_chunk_bytes=self.cfg.min_chunk_bytes)
        async with AsyncExitStack() as held:
            while (msg := await reader.next()) is not None:
                seen = len(collected.parts)
                collected.add(msg)
                holds.hold(("step", id(msg)), msg.nbytes)
                for p in collected.parts[seen:]:
                    collected.declare(p, self._check_step_header(p, collected.parts[0]))
                    if p.index == 0:
                        await held.enter_async_context(self.slots.rank_slot(p.header.rank))
        if not collected.parts:  # (what a Step its client cancelled before its first message reads as)
            raise StreamEndedEarly("the Step stream is empty: it must carry at least one part")
        return collected.finish(), collected.one_reply

    def _check_step_header(self, p, first) -> int:
        """A Step part's header as its first chunk arrives: what its own RPC checks before reading a payload.
        Returns the payload bytes it declares (its chunks may carry no more: StepParts.declare)."""
        h = check_caller(p, first)
        if p.kind == ROWS:
            self.tables.check_rows_first(h)
            return h.num_ids * (8 + 4 * h.dim)  # (at most: a push naming its pulls sends no ids)
        _check_header_fields(h)
        if h.moved_from:  # a question for an old slot is a Push of no gradient; in a Step it was applied as a push
            raise InvalidRequest(f"moved_from is {h.moved_from} but a Step's dense part carries a gradient (moved_from "
                                 "0): ask for an old slot with a Push of length 0")
        part = self.layouts.push_part(h.layout_epoch, h.partition, h.version)  # the layout first, as Push does
        part.check_member(h.rank, h.trainer_id, h.fingerprint)
        wire = part.wire_dtype()
        check_stream_header(h, part.slice_length(), wire, self.cfg.max_push_bytes)
        return topk_payload_bytes(h.topk, h.length, wire) if h.topk else h.length * TORCH_DTYPES[wire].itemsize

    async def _step_table(self, p, deadline: float, context, checked: bool = False) -> TablePart:
        """A Step's table part read and bounded on the loop (header, the wait for an open round, pull ids and the
        reply's bytes, held now, row tiling): its TablePart, for the trip to check and apply.  ``checked``: its
        header was checked (``_run_parts``), only the table it names is looked up."""
        first, h = p.chunks[0], p.header
        table = self.layouts.rows_head(h.layout_epoch, h.table, h.version).tables.get(h.table) if checked \
            else self.tables.check_rows_first(h)
        calls = self.tables.rows_at(h.layout_epoch)
        waits = h.version > table.version  # (one ahead of its table: it may wait for the open round's close)
        table = await calls.wait_push_base(table, h.table, h.rank, h.version, deadline)  # before check_push
        pull_ids = None
        if h.pull_ids or h.packed_pull_ids:
            pull_ids = calls.pull_ids(h.pull_ids, h.packed_pull_ids, "pull_ids")
            _check_pull_bytes(len(pull_ids), table.spec.dim,
                              min(self.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
            context.hold(("rows", id(h)), len(pull_ids) * table.spec.dim * 4)  # before any row is made
        ids, grads = await self.tables.read_rows(_Received(p.chunks, deadline, start=1), first, h, context.requests)
        push = RowsPush(h.rank, h.trainer_id, h.version, h.num_samples, h.sequence, ids, grads)
        # ids once: a push naming one pull whole keeps that pull's check (RowCalls.push_checked)
        return TablePart(h, table, push, pull_ids, pushed=calls.push_checked(h, table, ids), waited=waits)

    async def _step_trip(self, dense, tables: list[TablePart], context, checked: bool = False):
        """The Step's dense gradient read into a receive buffer, then its one trip (run_trip): the dense part's
        (header, PushResult) -- a stale push as a result, as PushPull answers it -- or None without one.
        ``checked``: its header is checked and unchanged since (``_run_parts``)."""
        refuse = self.cfg.nonfinite == "refuse"
        # the tables of the layout the parts name (one caller, one layout: step_parts.check_caller)
        calls = self.tables.rows_at(tables[0].header.layout_epoch) if tables else self.tables.rows

        def trip(push=None):
            return run_trip(calls.shard, tables, refuse, push, lambda: self.runtime.stopping)

        if dense is None:
            await calls.run_all([(t.table, t.elements) for t in tables], trip)
            return None
        reader = _Received(dense.chunks, self.slots.deadline(context), start=1)  # its header is read (step_parts)
        first, h = dense.chunks[0], dense.header
        # again, unless checked since: a table part before it may have waited for a round
        part = self.layouts.part(h.layout_epoch, h.partition) if checked else self.dense.check_push_first(h)
        async with self.runtime.buffers.take(part.slice_length()) as held:
            grad = await self.dense.read_tensor(part, reader, first, h, out=held.buffer, sparse=True)
            out = await held.hand_over(calls.run_all(
                [(t.table, t.elements) for t in tables], trip,
                functools.partial(_stale_as_result, self.dense.check_and_push, part, h, grad)))
            if isinstance(out, PushResult):  # stale: the buffer was not taken
                return h, out
            result, held.buffer = out
        return h, result

    async def _step_table_reply(self, t: TablePart, context, deadline: float) -> None:
        """A table part's reply once the trip is back: its error as the call's status, else its push's outcome
        with the rows the trip pulled -- or, where the version was not there yet, pulled after PullRows' wait."""
        if t.error is not None:
            raise t.error
        h = t.header
        if t.checked is None:
            layout = self.layouts.newest
            await context.write(_pb.RowsChunk(header=_pb.RowsHeader(table=h.table, dim=h.dim, layout_epoch=layout,
                                                                    push=_push_reply(t.result, layout))))
            return
        waited, table, calls = 0.0, t.table, self.tables.rows_at(h.layout_epoch)
        if t.pulled is not None:
            version, rows = t.pulled
        else:
            min_version = reply_version(table.mode, t.result.outcome, h.version, t.result.version)
            waited, table, version, rows = await calls.pull(
                table, h.table, h.rank, h.trainer_id, h.fingerprint, min_version, t.checked, deadline,
                lambda _nbytes: None)  # held before the trip
        self.count("row_push_pulls")
        layout = self.layouts.newest  # (a table part's reply goes out with the Step's dense part, held or not)
        header = _pb.RowsHeader(table=h.table, version=version, num_ids=len(t.checked.ids), dim=table.spec.dim,
                                wait_seconds=waited, push=_push_reply(t.result, layout), layout_epoch=layout,
                                pull_ref=calls.remember(h, t.checked))  # (ids once, as PushPullRows)
        for chunk in row_chunks(rows, header, self.cfg.chunk_bytes, raw=True):
            await context.write(chunk, self.cfg.chunk_bytes)


class _PartStream:
    """A Step part's reply stream: its messages go out as StepChunks of its number, through the call's
    ReplyStream (whose deadline and held bytes bound them all), one part's write at a time (``turn``, the
    call's; None: the parts reply in turn, StepOnce); anything else is the call's."""

    def __init__(self, stream: ReplyStream, index: int, turn: asyncio.Lock | None = None):
        self._stream, self._index, self._turn = stream, index, turn

    def __getattr__(self, name):
        return getattr(self._stream, name)

    async def write(self, message, nbytes: int = 0) -> None:
        wrapped = StepMessage(part=self._index, rows=message) if isinstance(message, (_pb.RowsChunk, RawRowsChunk)) else \
            StepMessage(part=self._index, dense=message)
        if self._turn is None:
            await self._stream.write(wrapped, nbytes)
            return
        async with self._turn:  # gRPC takes one write at a time on a call
            await self._stream.write(wrapped, nbytes)


REPLAY_SLICE_BYTES = 4 << 20  # a replayed part hands the event loop back after this many bytes of its chunks


class _Received:
    """Chunks already received whole (a Step part's, or StepOnce's one message) read as its RPC's handler reads a
    request stream (``next``, ``deadline``).  Not a _StreamReader over a generator: nothing is on its way, so there
    is no idle timer to arm and cancel and no generator to step (~0.2 ms of the loop's 8 a small step under
    cProfile); the call's deadline still ends a read past it.  The event loop is handed back every
    REPLAY_SLICE_BYTES: the reader copies each chunk on the loop, and a part received whole was copied in one go
    (0.7 s of a loop stall for a table part of 10**6 rows of dim 64; heartbeats and health checks wait)."""

    def __init__(self, chunks: list, deadline: float, start: int = 0):
        self._chunks, self._next, self._since, self.deadline = chunks, start, 0, deadline

    async def next(self):
        """The next chunk, or None after the last."""
        if self._next >= len(self._chunks):
            return None
        if self._since >= REPLAY_SLICE_BYTES:
            self._since = 0
            await asyncio.sleep(0)
        if asyncio.get_running_loop().time() >= self.deadline:
            raise StreamTimeout("the call outlived the shard's limit on one call's duration (--max-call-seconds)")
        chunk = self._chunks[self._next]
        self._next += 1
        self._since += _nbytes(chunk)
        return chunk


def _nbytes(chunk) -> int:
    """A chunk's payload bytes: a dense chunk's data, a rows chunk's ids and rows, a StepOnce request's size."""
    if isinstance(chunk, StepMessage):
        return chunk.nbytes
    return len(chunk.data) if hasattr(chunk, "data") else len(chunk.ids) + len(chunk.rows)


async def _first_error(coros: list) -> None:
    """Run ``coros`` side by side; the first that raises cancels the others and is raised (the call's status)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()


def _stale_as_result(check_and_push, part: Shard, h: _pb.ChunkHeader, grad: torch.Tensor):
    """A Step's dense push on the state worker: (PushResult, spare buffer), or a stale push's PushResult (counted
    by the shard; the reply catches up), as PushPull answers it."""
    try:
        return check_and_push(part, h, grad)
    except StaleGradient as e:
        return PushResult(STALE, e.version, e.staleness)
