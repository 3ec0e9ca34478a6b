"""The steady-state StepOnce: the same trainer, job and layout as its last step, with the control plane consulted
once (issue 33; docs/performance.md, "The step engine").

Why a room of its own: the general path (psserver.step_parts, psserver.service_step) serves every shape a Step may
take -- streams, several chunks a part, top-k, a question for an old slot, a leave, a claim, several layouts, a
re-shard under way -- and re-derives at each of its doors what a steady-state step's caller already established:
that it is a member, that its headers are well formed and bounded, which partition and tables it names.  A step
session per (connection, rank) remembers what the last general step resolved; the next step of that caller is
run here when every integer it declares matches the session and the objects the session resolved are still the
ones the shard serves (the *guards*).  Anything else -- a guard miss, a size past a bound, a header field the
engine does not know -- returns None before anything changed, and the general path runs as it always did, with
all its refusals.  The engine has no refusals of its own.

What runs here is the general path's work on the shard's state, call for call and in the same order (the table
parts' waits, pull ids, remembered pulls and pushes, the trip with its dense push, table pushes and pulls, each
part's reply) -- what it skips is only the envelope: parsing the parts into StepParts, the headers' checks a
second to fifth time, a chunk assembler for a payload that is one chunk, the per-part reply streams.  So its
replies, state and counters are the general path's (tests/integration/test_step_engine.py runs both on the same
steps and compares reply bytes, state digests and counters).  Switched off by ``ps-server --no-step-engine``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from psserver.protocol import limits
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.errors import TooLarge
from psserver.protocol.fastwire import RawRowsChunk
from psserver.protocol.stepwire import pack_serialized, serialize_step, StepMessage
from psserver.push_book import PushResult
from psserver.service_common import _check_pull_bytes
from psserver.sparse.serving import RowsPush
from psserver.step_reply import MORE_OVERHEAD
from psserver.step_trip import TablePart, run_trip

MAX_SESSIONS = 4096  # one a trainer's connection and rank (limits.MAX_TRAINERS trainers of one job), oldest out


@dataclass(eq=False)
class StepSession:
    """What a caller's last general step resolved: who it is and which of the shard's objects it names."""

    rank: int
    trainer_id: str
    fingerprint: str
    part: object  # the Shard (partition 0 of layout 0) its dense part and tables live on
    job: object  # that partition's JobSpec when the session was made (a new job or a restore replaces it)
    calls: object  # the RowCalls of its tables
    length: int  # the dense slice's elements


@dataclass(eq=False)
class _Dense:
    header: _pb.ChunkHeader
    data: memoryview


@dataclass(eq=False)
class _Table:
    index: int
    header: _pb.RowsHeader
    chunk: _pb.RowsChunk
    table: object  # the ServedTable it names


class StepEngine:
    """StepOnce's steady state for a servicer (psserver.service.ParameterServerService): ``step_once`` answers a
    step or returns None (the general path's turn); ``learn`` makes a session from a general step that
    succeeded."""

    def __init__(self, service, max_sessions: int = MAX_SESSIONS):
        self.svc, self.max_sessions = service, max_sessions
        self.sessions: OrderedDict[tuple[str, int], StepSession] = OrderedDict()

    # ------------------------------------------------------------------ sessions
    def learn(self, parts: list, peer: str) -> None:
        """After a general StepOnce answered: the session its caller's next steps may take here.  Only the shape
        the engine runs -- one layout with no re-shard under way, one partition, float32 on the wire."""
        svc = self.svc
        if not svc.layouts.single():
            return
        h = parts[0].header
        part = svc.layouts.part(0, 0)
        job = part.job
        if job is None or job.partitions > 1 or part.wire_dtype() != _pb.FLOAT32 or h.layout_epoch or \
                getattr(h, "partition", 0):
            return
        if self.sessions and next(iter(self.sessions.values())).part is not part:
            self.sessions.clear()  # a restore or a new job: the old sessions would keep the old partition alive
        key = (peer, h.rank)
        self.sessions[key] = StepSession(h.rank, h.trainer_id, h.fingerprint, part, job, svc.rows,
                                         part.slice_length())
        self.sessions.move_to_end(key)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def forget(self) -> None:
        self.sessions.clear()

    def _session(self, peer: str, first) -> StepSession | None:
        """The caller's session if its guards hold: the same layout state, partition, job and row calls."""
        s = self.sessions.get((peer, first.rank))
        if s is None:
            return None
        svc = self.svc
        if not (svc.layouts.single() and svc.layouts.part(0, 0) is s.part and s.part.job is s.job
                and svc.rows is s.calls):
            del self.sessions[(peer, first.rank)]  # what it resolved is gone: the general path makes a new one
            return None
        if first.trainer_id != s.trainer_id or first.fingerprint != s.fingerprint:
            return None
        return s

    # ------------------------------------------------------------------ the guards: nothing changes before them
    def _plan(self, msg: StepMessage, peer: str):
        """(session, dense part or None, table parts) when the request is a step the engine runs, else None.

        Every check here is one the general path makes before anything changes (psserver.step_parts, the parts'
        header checks, ``_check_push_first``, ``_check_rows_first``): where one would refuse, or could, None."""
        if msg.malformed or msg.dense is None and msg.rows is None:
            return None
        chunks = msg.flat()
        if msg.nbytes > self.svc.cfg.max_push_bytes or len(chunks) > 1 + limits.MAX_TABLES:
            return None
        first = chunks[0].dense.header if chunks[0].dense is not None else \
            chunks[0].rows.header if chunks[0].rows.HasField("header") else None
        if first is None:
            return None
        s = self._session(peer, first)
        if s is None:
            return None
        dense, tables, names = None, [], set()
        for i, m in enumerate(chunks):
            if m.part != i:  # one chunk a part: parts numbered 0, 1, ... in order
                return None
            if m.dense is not None:
                if i or not self._dense_ok(s, m):
                    return None
                dense = _Dense(m.dense.header, m.dense.data)
            else:
                t = self._table_ok(s, m, first.layout_epoch)
                if t is None or t.header.table in names:
                    return None
                names.add(t.header.table)
                tables.append(t)
        return s, dense, tables

    def _dense_ok(self, s: StepSession, m: StepMessage) -> bool:
        c = m.dense
        h = c.header
        if c.malformed or h is None or c.offset or h.topk or h.moved_from or h.leaving or h.claim or \
                h.batches_per_epoch or h.partition or h.layout_epoch:
            return False
        if (h.rank, h.trainer_id, h.fingerprint) != (s.rank, s.trainer_id, s.fingerprint):
            return False
        nbytes = s.length * 4
        if h.dtype != _pb.FLOAT32 or h.length != s.length or len(c.data) != nbytes or nbytes > self.svc.cfg.max_push_bytes:
            return False
        if m.wire > nbytes + limits.STEP_PART_HEADER_BYTES + limits.STEP_CHUNK_FRAMING_BYTES:
            return False
        if not 1 <= h.num_samples <= limits.MAX_NUM_SAMPLES or h.sequence > limits.MAX_SEQUENCE:
            return False
        part = s.part
        if part.params is None or h.version > part.version:
            return False
        try:
            part.enrolment.check_base(part.job, h.rank, h.version)
        except Exception:  # noqa: BLE001 -- the general path refuses it
            return False
        return True

    def _table_ok(self, s: StepSession, m: StepMessage, layout_epoch: int) -> _Table | None:
        c = m.rows
        if c is None or not c.HasField("header") or c.offset:
            return None
        h = c.header
        if (h.rank, h.trainer_id, h.fingerprint, h.layout_epoch) != (s.rank, s.trainer_id, s.fingerprint,
                                                                       layout_epoch) or layout_epoch:
            return None
        table = s.part.tables.by_name.get(h.table)
        if table is None or h.dim != table.spec.dim or h.num_ids > limits.MAX_IDS_PER_CALL:
            return None
        if not 1 <= h.num_samples <= limits.MAX_NUM_SAMPLES or h.sequence > limits.MAX_SEQUENCE:
            return None
        declared = h.num_ids * (8 + 4 * h.dim)
        if declared > self.svc.cfg.max_push_bytes:
            return None
        named = bool(h.pull_refs)
        ids, rows = c.ids, c.rows
        if len(rows) != h.num_ids * h.dim * 4 or len(ids) != (0 if named else h.num_ids * 8):
            return None
        sized = len(h.pull_ids) + len(h.packed_pull_ids) + len(h.extra_ids) + 10 * len(h.pull_refs)
        if m.wire > declared + sized + limits.STEP_PART_HEADER_BYTES + limits.STEP_CHUNK_FRAMING_BYTES:
            return None
        return _Table(m.part, h, c, table)

    # ------------------------------------------------------------------ the step
    async def step_once(self, msg: StepMessage, context) -> bytes | None:
        """The reply's bytes, or None: the general path answers (nothing was changed here)."""
        svc = self.svc
        plan = self._plan(msg, context.peer_name)
        if plan is None:
            svc.count("step_engine_misses")
            return None
        s, dense, tables = plan
        if svc.rank_calls(s.rank) >= svc.cfg.max_calls_per_rank:
            svc.count("step_engine_misses")
            return None  # (refused by the general path, counted there)
        context.requests.hold(("step", id(msg)), msg.nbytes)  # first, as the general path's _step_parts: may refuse
        try:
            s.part.check_member(s.rank, s.trainer_id, s.fingerprint, need_params=dense is not None)
        except Exception:  # noqa: BLE001 -- a member no more: the general path refuses (its hold is this one)
            svc.count("step_engine_misses")
            return None
        svc.count("step_engine_steps")
        # -- from here on, the general path's calls in its order (psserver.service_step StepRpc._step) --
        deadline = svc.call_deadline(context)
        parts, waited = [], False
        for t in tables:
            if waited:  # a table part before this one waited for its round: check this one's header again
                svc.check_rows_header(t.header)
            waited = waited or t.header.version > t.table.version
            parts.append((t.index, await self._table_part(t, deadline, context)))
        dense_header = dense.header if dense is not None else None
        svc.check_once_reply(dense_header, [p for _, p in parts])
        svc.count("step_calls")
        svc.count("step_calls_once")
        async with svc.rank_slot(s.rank):
            pushed = await self._trip(s, dense, [p for _, p in parts], waited)
            return await self._replies(pushed, dense_header, parts, context, deadline)

    async def _table_part(self, t: _Table, deadline: float, context) -> TablePart:
        """``StepRpc._step_table`` for a part of one chunk."""
        svc, h = self.svc, t.header
        calls = svc.rows_at(h.layout_epoch)
        table = await calls.wait_push_base(t.table, h.table, h.rank, h.version, deadline)
        pull_ids = None
        if h.pull_ids or h.packed_pull_ids:
            pull_ids = calls.pull_ids(h.pull_ids, h.packed_pull_ids, "pull_ids")
            _check_pull_bytes(len(pull_ids), table.spec.dim,
                              min(svc.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
            context.hold(("rows", id(h)), len(pull_ids) * table.spec.dim * 4)
        n, dim = h.num_ids, h.dim
        context.requests.hold(("rows", id(h)), n * (4 * dim + 8))  # (RowRpcs._read_rows, one chunk)
        named = calls.push_ids(h)  # (resolve refuses a count not num_ids)
        ids = named if named is not None else torch.from_numpy(np.frombuffer(t.chunk.ids, dtype=np.int64).copy())
        grads = torch.from_numpy(np.frombuffer(t.chunk.rows, dtype=np.float32).copy()).view(n, dim)
        svc.count("bytes_in", n * (4 * dim + (8 if named is None else 0)))
        push = RowsPush(h.rank, h.trainer_id, h.version, h.num_samples, h.sequence, ids, grads)
        return TablePart(h, table, push, pull_ids, pushed=calls.push_checked(h, table, ids))

    async def _trip(self, s: StepSession, dense: _Dense | None, tables: list[TablePart], waited: bool):
        """``StepRpc._step_trip`` with the dense payload of one chunk copied straight into a receive buffer."""
        svc = self.svc
        refuse = svc.cfg.nonfinite == "refuse"
        calls = svc.rows_at(tables[0].header.layout_epoch) if tables else svc.rows
        sized = [(t.table, t.elements) for t in tables]

        def trip(push=None):
            return run_trip(calls.shard, tables, refuse, push, lambda: svc.runtime.stopping)

        if dense is None:
            await calls.run_all(sized, trip)
            return None
        h = dense.header
        part = svc.check_push_first(h) if waited else s.part  # again after a wait, as the general path
        async with svc.runtime.buffers.take(part.slice_length()) as held:
            held.buffer.numpy().view(np.uint8)[:] = np.frombuffer(dense.data, dtype=np.uint8)
            svc.count("bytes_in", len(dense.data))
            out = await held.hand_over(calls.run_all(sized, trip, svc.stale_as_result(part, h, held.buffer)))
            if isinstance(out, PushResult):  # stale: the buffer was not taken
                return h, out
            result, held.buffer = out
        return h, result

    async def _replies(self, pushed, dense_header, parts: list, context, deadline: float) -> bytes:
        """``StepRpc._replies_in_turn`` into one message, and ``OneReply.take``: each part's messages serialized
        as the general path writes them, packed."""
        svc = self.svc
        for _, t in parts:
            if t.error is not None:
                raise t.error
        sink = _Sink(context, svc.cfg.max_message_bytes)
        if dense_header is not None:
            await svc.pull_pushed(*pushed, sink.part(0))
        for index, t in parts:
            await svc.step_table_reply(t, sink.part(index), deadline)
        if not sink.kept:
            return b""
        svc.count("step_replies_packed")
        return pack_serialized(sink.kept)


class _Sink:
    """Where the parts' reply messages go: serialized and kept, in order (psserver.step_reply.OneReply's job for
    a StepOnce); everything else (``hold``, ``peer``, the deadline) is the call's ReplyStream's."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit, self.kept, self.nbytes = stream, limit, [], 0

    def part(self, index: int) -> "_PartSink":
        return _PartSink(self, index)


class _PartSink:
    def __init__(self, sink: _Sink, index: int):
        self._sink, self._index = sink, index

    def __getattr__(self, name):
        return getattr(self._sink.stream, name)

    async def write(self, message, nbytes: int = 0) -> None:
        wrapped = StepMessage(part=self._index, rows=message) if isinstance(message, (_pb.RowsChunk, RawRowsChunk)) else \
            StepMessage(part=self._index, dense=message)
        data = serialize_step(wrapped)
        sink = self._sink
        sink.kept.append(data)
        sink.nbytes += len(data) + MORE_OVERHEAD
        if sink.nbytes > sink.limit:  # (bounded before the trip: _check_once_reply; as OneReply refuses it)
            raise TooLarge(f"the one-message reply holds {sink.nbytes} bytes so far, over the limit of "
                           f"{sink.limit} bytes")
