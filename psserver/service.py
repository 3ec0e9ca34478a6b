"""The gRPC servicer (grpc.aio): decode, bound, call the shard, encode, map errors to status codes.

Why asyncio: a trainer waiting for its round is an awaited future here, not a
parked thread, so one shard serves as many waiting trainers as it has memory
for, and Health and Heartbeat are answered by the event loop between any two
chunks of anyone's stream.  The rules of the house:

* The event loop never waits on tensor work.  Every shard method that touches
  tensors or the round, and the finite check of a received gradient, runs on
  one *state worker* thread (``Runtime.state``) -- or on the loop when the
  slice is so small that the hop costs more.  On the loop itself: parsing,
  bounds checks, lease renewal, copying received chunks into a buffer, and
  streaming replies.
* Nothing a client declares is trusted before it is bounded (psserver.protocol.limits),
  and a caller is identified (job, rank, trainer id) before its payload is read.
* Every stream has an idle and a total deadline enforced here, whatever the
  client asked for; a call whose client went away is cancelled by gRPC and its
  waits end at once.
* Every refusal goes through ``_refusals``: counted in full, logged at a
  bounded rate, aborted with its one documented status code.

Why it is long (~870 lines): one method per RPC (thirteen), each decoding and bounding its own message, plus
the chunk-stream reader and the checks of a row stream's tiling that must run on the loop as chunks arrive.
Step runs the other handlers' halves on its parts, so it lives beside them; its envelope is psserver.step_parts.
The table RPCs' logic (ids checked once, waits, where the work runs) lives in psserver/sparse/calls.py.
``ParameterServerService`` itself is ~400 lines for the same reason: it is those thirteen methods and their
stream readers, and splitting the RPCs among classes would split the one place errors become status codes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from psserver import modes
from psserver.common.logsafe import RateLimitedLog, counted, shorten
from psserver.host import ShardHost
from psserver.layout_host import LayoutHost
from psserver.protocol import limits, stubs
from psserver.protocol.codec import (
    DEFAULT_CHUNK_BYTES,
    ChunkAssembler,
    TopKAssembler,
    check_finite,
    check_stream_header,
    encode_raw,
    first_header,
)
from psserver.protocol.errors import (
    InvalidRequest,
    NotReady,
    PsError,
    ShuttingDown,
    StaleGradient,
    StreamTimeout,
    TooBusy,
    TooLarge,
    WaitTimeout,
)
from psserver.protocol.fastwire import parse_chunk, serialize_chunk
from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows.errors import WrongShape
from psserver.protocol.rows.wire import row_chunks
from psserver.protocol.rules import STALE, reply_version
from psserver.protocol.stepwire import StepMessage, parse_step, serialize_step
from psserver.replies import Connections, ReplyCut, ReplyLedger, ReplyStream
from psserver.runtime import Runtime
from psserver.shard import PushResult, Shard
from psserver.sparse.calls import RowCalls
from psserver.sparse.serving import RowsPush
from psserver.step_parts import DENSE, ROWS, StepParts, check_caller
from psserver.step_trip import TablePart, run_trip

log = logging.getLogger(__name__)

_OUTCOMES = {"applied": _pb.APPLIED, "accepted": _pb.ACCEPTED, "duplicate": _pb.DUPLICATE, "scaled": _pb.SCALED,
             "skipped": _pb.SKIPPED, "stale": _pb.STALE}


@dataclass(frozen=True)
class ServiceLimits:
    """What one caller may hold of a shard (flags of ps-server; see ServerConfig)."""

    max_push_bytes: int = 4 << 30  # one Init/Push stream
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # chunks of the streams this shard sends
    max_pull_wait: float = 600.0  # longest a pull waits for a version
    stream_idle_timeout: float = 30.0  # a stream that sends nothing this long is ended
    max_call_seconds: float = 900.0  # no call lives longer, whatever deadline its client set
    max_calls_per_peer: int = 64  # data calls (and health Watch streams) in flight on one connection
    max_connections: int = 4096  # connections with calls in flight (MAX_TRAINERS: one connection per trainer)
    max_watch_streams: int = 64  # health Watch streams open on the main port
    max_reply_bytes_per_peer: int = 256 << 20  # bytes of unread replies one connection may hold (one always)
    max_reply_bytes: int = 1 << 30  # bytes of unread replies the shard may hold (one reply always)
    max_calls_per_rank: int = 8  # data calls in flight naming one rank
    min_chunk_bytes: int = limits.MIN_CHUNK_BYTES  # every chunk of a stream but the last carries at least this
    receive_buffers: int = 8  # slice-sized receive buffers at least (more while they fit in 256 MB); pushes beyond
    # wait, their bytes held back by gRPC's flow control
    nonfinite: str = "refuse"  # NaN/Inf gradients: "refuse" (INVALID_ARGUMENT) or "skip" (counted, not applied)

    def __post_init__(self) -> None:
        if self.nonfinite not in ("refuse", "skip"):
            raise ValueError(f"The non-finite policy ({self.nonfinite!r}) must be 'refuse' or 'skip'.")
        for name in ("stream_idle_timeout", "max_call_seconds", "max_pull_wait"):
            value = getattr(self, name)
            if not 0 < value <= limits.MAX_SYNC_TIMEOUT:
                raise ValueError(f"The {name.replace('_', ' ')} ({value} s) must be between 0 and "
                                 f"{limits.MAX_SYNC_TIMEOUT:.0f} seconds.")
        for name in ("max_calls_per_peer", "max_calls_per_rank", "receive_buffers", "max_connections",
                     "max_watch_streams", "max_reply_bytes_per_peer", "max_reply_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"The {name.replace('_', ' ')} ({getattr(self, name)}) must be at least 1.")


class _Undecodable:
    """What a request that protobuf could not parse becomes, so the handler refuses it as INVALID_ARGUMENT
    (a deserializer that raises would make gRPC answer INTERNAL)."""

    def __init__(self, error: Exception):
        self.error = error


def _safe(parse):
    def parse_or_mark(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 -- any parse failure is the client's malformed bytes
            return _Undecodable(e)

    return parse_or_mark


def _decoded(request):
    if isinstance(request, _Undecodable):
        raise InvalidRequest(f"the request could not be decoded: {shorten(str(request.error), 120)}")
    return request


def _refusals(method):
    """Turn PsError into context.abort with its code; count every refusal and log them at a bounded rate;
    count calls their clients abandoned."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:  # the client went away (or its deadline passed): counted, not logged
            self.shard.count("calls_cancelled")
            raise
        except PsError as e:
            code = e.code
            if e.trailers():  # what the client acts on (a reason, a stale push's version): psserver.protocol.rules
                context.set_trailing_metadata(e.trailers())
            if isinstance(e, WaitTimeout):  # a wait that ended, not bad input: trainers poll while peers start
                self.shard.count("pull_wait_timeouts")
                self.refusal_log.log(logging.INFO, f"{method.__name__}:wait", "shard %d: %s", self.shard.shard_id, e)
            elif not isinstance(e, StaleGradient):  # a stale push is counted and logged by the shard (stale_dropped)
                self.shard.count(f"refused_{code.name}")
                self.refusal_log.warning(f"{method.__name__}:{code.name}", "shard %d: %s refused with %s: %s",
                                         self.shard.shard_id, method.__name__, code.name, e)
            await context.abort(code, str(e))

    return wrapper


def _reply_stream(method):
    """Every server-streaming handler (Pull, PullRows, PushPull; wrap new ones the same way, inside
    ``_refusals``): a call of its connection, a ``ReplyStream`` for a context -- writes that end at the call's
    deadline, bytes held counted per connection and for the shard -- and, when a reader stalled past the
    deadline, DEADLINE_EXCEEDED, counted (``reply_streams_cut``) and logged at a bounded rate.  The connection's
    call and the message gRPC still holds stay counted until that status is out (or the client is gone)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        with self._peer_slot(context):
            stream = ReplyStream(context, self._deadline(context), self.replies)
            try:
                return await method(self, request, stream)
            except ReplyCut as e:
                stream.release_held()  # the handler's snapshot or rows are free now; the status may wait
                self.shard.count("reply_streams_cut")
                self.refusal_log.warning(f"{method.__name__}:cut", "shard %d: %s reply to %s cut: %s",
                                         self.shard.shard_id, method.__name__, shorten(stream.peer_name), e)
                await context.abort(e.code, str(e))
            finally:
                stream.close()

    return wrapper


class _StreamReader:
    """A request stream read with the server's idle and total deadlines.

    One timer per stream, armed at the first read and re-armed only when it fires early: a read notes when it
    began, and the timer, at its time, cancels the handler's task if a read has waited ``idle`` (or the call
    reached its deadline) -- or moves itself to that read's due time.  Cheaper than ``asyncio.wait_for`` (a
    task per read) and than a timer per read (two per one-chunk push: arm and cancel each).
    """

    def __init__(self, iterator, idle: float, deadline: float):
        self._it = iterator.__aiter__()
        self._idle, self._deadline = idle, deadline
        self._fired = False
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None  # the task in a read now (None between reads)
        self._since = 0.0  # loop time the read now waiting began
        self._watched = False  # the handler's task cancels the timer when it ends (a handler that stops early)

    @property
    def deadline(self) -> float:
        """The call's deadline (loop time): what a wait inside the call is bounded by."""
        return self._deadline

    def _due(self) -> float:
        return min(self._since + self._idle, self._deadline)

    def _check(self) -> None:
        """The timer: cut the read now waiting if it is due, else wait for it (or for the next read)."""
        self._timer = None
        if self._task is None:
            return  # between reads: the next read arms it again
        loop = self._task.get_loop()
        if loop.time() >= self._due() - 1e-3:  # (call_at may run a hair early)
            self._fired = True
            self._task.cancel()
        else:
            self._timer = loop.call_at(self._due(), self._check)

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def next(self):
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._deadline - now <= 0:
            self._close()
            raise StreamTimeout("the call outlived the shard's limit on one call's duration (--max-call-seconds)")
        self._since, self._task = now, asyncio.current_task()
        if self._timer is None:
            self._timer = loop.call_at(self._due(), self._check)
            if not self._watched:
                self._watched = True
                self._task.add_done_callback(lambda _task: self._close())
        try:
            chunk = await self._it.__anext__()
        except StopAsyncIteration:
            self._close()
            return None
        except asyncio.CancelledError:
            self._close()
            if not self._fired:
                raise  # the client went away: gRPC cancelled the call
            task = asyncio.current_task()
            if hasattr(task, "uncancel"):  # Python 3.11+: clear the cancellation this timer requested
                task.uncancel()
            raise StreamTimeout(
                f"no chunk arrived for {self._due() - self._since:.1f} s: the shard ends idle streams "
                "(--stream-idle-timeout) and calls past --max-call-seconds") from None
        except BaseException:
            self._close()
            raise
        finally:
            self._task = None
        return chunk

    async def first_header(self):
        first = await self.next()
        if first is None:
            raise InvalidRequest("the stream is empty: the first chunk must carry a header")
        return first, first_header(first)


def _check_identity(request) -> None:
    """Bound the strings a caller identifies itself with before they are compared, stored or logged."""
    limits.check_id("trainer_id", request.trainer_id)
    limits.check_id("fingerprint", request.fingerprint)


def _is_member(part: Shard, request) -> bool:
    """Whether the request names a member of ``part``'s job; identity strings past their bounds name none
    (a read for the caller's own benefit: not refused, nothing stored or logged)."""
    try:
        _check_identity(request)
    except InvalidRequest:
        return False
    return part.is_member(request.rank, request.trainer_id, request.fingerprint)


def _claim_answer(part: Shard, h: _pb.ChunkHeader) -> dict:
    """A PushPull reply's grant of the claim its push carried (none if the push was dropped as stale: the
    trainer asks again with ClaimBatch, under the same number)."""
    held = part.cursor.claims.get(h.rank) if h.claim else None
    if held is None or held.trainer_id != h.trainer_id or held.number != h.claim or held.batch is None:
        return {}
    return dict(batch=held.batch, batch_granted=True, batch_reissued=held.reissued)


def _check_header_fields(h: _pb.ChunkHeader) -> None:
    _check_identity(h)
    if h.num_samples > limits.MAX_NUM_SAMPLES:
        raise InvalidRequest(f"num_samples is {h.num_samples}, over the limit of {limits.MAX_NUM_SAMPLES}")
    if h.sequence > limits.MAX_SEQUENCE:
        raise InvalidRequest(f"sequence is {h.sequence}, over the limit of {limits.MAX_SEQUENCE}")


class ParameterServerService:
    def __init__(self, host: ShardHost, runtime: Runtime, cfg: ServiceLimits = ServiceLimits(),
                 authenticated: bool = False, connections: Connections | None = None,
                 replies: ReplyLedger | None = None, layouts: LayoutHost | None = None, handoffs=None):
        # Dense calls go to the partition of the layout they name (psserver.layout_host, psserver.host); counters,
        # refusals and the sparse tables are layout 0's partition 0's, ``self.shard``.  ``authenticated``: every
        # caller proved itself before reaching here (a token or mutual TLS), so members-only answers need no membership.
        self.layouts, self.shard, self.runtime, self.cfg = layouts or LayoutHost(host), host.head, runtime, cfg
        self.authenticated = authenticated
        self.refusal_log = RateLimitedLog(log)
        # Calls per connection and connections (shared with the health service's Watch streams), and the bytes
        # unread replies hold (psserver.replies; made by psserver.server.build_shard_process, which reads them).
        self.connections = connections or Connections(cfg.max_calls_per_peer, cfg.max_connections,
                                                      cfg.max_watch_streams, self.shard.count)
        self.replies = replies or ReplyLedger(cfg.max_reply_bytes_per_peer, cfg.max_reply_bytes)
        self._per_rank: dict[tuple[int, int], int] = {}  # (rank, partition) -> calls in flight
        self.rows = RowCalls(self.shard, runtime, cfg.max_pull_wait)  # the row calls' table steps
        self.handoffs = handoffs  # a live re-shard's Reshard and Handoff calls (psserver.handoff_io)

    @property
    def host(self) -> ShardHost:
        return self.layouts.current  # the newest layout's: Register, Leave, Heartbeat, ClaimBatch, GetStats

    # ------------------------------------------------------------------ limits
    @asynccontextmanager
    async def _slot(self, table: dict, key, limit: int, what: str):
        if table.get(key, 0) >= limit:
            self.shard.count("refused_over_limit")
            raise TooBusy(f"{what} already has {counted(table[key], 'call')} in flight, the limit is {limit}")
        table[key] = table.get(key, 0) + 1
        try:
            yield
        finally:
            table[key] -= 1
            if not table[key]:
                del table[key]

    def _peer_slot(self, context):
        """One call of the caller's connection (--max-calls-per-peer, --max-connections)."""
        return self.connections.call(context.peer() or "?")

    def _rank_slot(self, rank: int, partition: int = 0):
        """Per rank and partition: a trainer of a partitioned job has one push in flight per partition."""
        return self._slot(self._per_rank, (rank, partition), self.cfg.max_calls_per_rank,
                          f"rank {rank}" + (f" on partition {partition}" if partition else "") +
                          " (--max-calls-per-rank)")

    def _deadline(self, context) -> float:
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        limit = self.cfg.max_call_seconds if remaining is None else min(remaining, self.cfg.max_call_seconds)
        return loop.time() + limit

    # ------------------------------------------------------------------ unary RPCs
    @_refusals
    async def Register(self, request, context):
        request = _decoded(request)
        limits.check_id("trainer_id", request.trainer_id)
        try:
            job = JobSpec.from_proto(request.job)
        except ValueError as e:
            raise InvalidRequest(f"job spec: {e}") from None
        part = self.layouts.register_host(request.layout_epoch).part_for_register(
            request.partition, request.rank, request.expected_shard, job, request.join)
        r = await self.runtime.run_state(part.register, request.rank, request.trainer_id,
                                         request.expected_shard, job, request.join, request.join_round,
                                         request.join_confirm)
        return _pb.RegisterReply(**r, layout_epoch=self.layouts.newest)

    @_refusals
    async def Leave(self, request, context):
        request = _decoded(request)
        _check_identity(request)
        remaining = await self.runtime.run_state(self.host.part(request.partition).leave, request.rank,
                                                 request.trainer_id,
                                                 request.fingerprint)
        return _pb.LeaveReply(remaining=remaining)

    @_refusals
    async def Heartbeat(self, request, context):
        """Answered on the event loop: a lease renewal never waits behind tensor work."""
        request = _decoded(request)
        _check_identity(request)
        version, live = self.host.heartbeat(request.partition, request.rank, request.trainer_id,
                                            request.fingerprint)
        return _pb.HeartbeatReply(version=version, live=live, layout_epoch=self.layouts.newest)

    @_refusals
    async def ClaimBatch(self, request, context):
        """The job's data cursor (psserver.data_cursor): the next batch of an async or stale-timeout trainer."""
        request = _decoded(request)
        _check_identity(request)
        grant = await self.runtime.run_state(self.host.part(0).claim_batch, request.rank, request.trainer_id,
                                             request.fingerprint, request.claim, request.batches_per_epoch,
                                             request.release)
        return _pb.ClaimReply(batch=grant.batch or 0, granted=grant.batch is not None, reissued=grant.reissued)

    @_refusals
    async def GetStats(self, request, context):
        """Counters, version, mode, slice and live ranks for anyone; the job's spec -- its identity (job id,
        fingerprint) and all a trainer needs to register as one of its ranks -- only for a member of the job
        (``rank``, ``trainer_id`` and ``fingerprint`` of a registered trainer) or, on a shard that authenticates
        every caller (a token or mutual TLS), for any caller.  Withheld, not refused: the reply has no ``job``."""
        request = _decoded(request)
        part = self.host.part(request.partition)
        s = self.host.snapshot(request.partition)
        digest = await self._digest(part, request) if request.with_digest else ""
        reply = _pb.StatsReply(shard=s.shard, initialized=s.initialized, version=s.version, mode=s.mode,
                               start=s.start, end=s.end, live_ranks=s.live_ranks, counters=s.counters,
                               state_digest=digest, lr=s.lr, partitions=len(self.host.parts),
                               epochs=part.epoch_timeline_proto(request.members_from_round))
        if s.job is not None and (self.authenticated or _is_member(part, request)):
            reply.job.CopyFrom(s.job.to_proto())
        if self.authenticated or any(_is_member(head, request) for head in self.layouts.heads()):
            reply.layouts.extend(self.layouts.timeline_proto())  # fingerprints: for a member of any layout
        if self.handoffs is not None:
            reply.handoffs.extend(self.handoffs.records())
        return reply

    @_refusals
    async def Reshard(self, request, context):
        """A live re-shard's coordinator call (psserver.handoff_io)."""
        return await self._handoffs().reshard(_decoded(request))

    @_refusals
    async def Handoff(self, request_iterator, context):
        """A live re-shard's source streaming to this destination (psserver.handoff_io)."""
        with self._peer_slot(context):
            return await self._handoffs().handoff(_decoded(c) async for c in request_iterator)

    def _handoffs(self):
        if self.handoffs is None:
            raise NotReady("handoffs is None but a live re-shard needs a shard process (psserver.server)")
        return self.handoffs

    def _digest(self, part: Shard, request) -> asyncio.Future:
        """The partition's state digest, for members (or any caller of a shard that authenticates them all),
        hashed on the state worker: a pass over a big table took seconds, and on the loop it held every
        heartbeat and health check that long."""
        if not self.authenticated:
            _check_identity(request)
            part.check_digest_caller(request.rank, request.trainer_id, request.fingerprint)
        return self.runtime.offload(part.state_digest)

    # ------------------------------------------------------------------ streams in
    @_refusals
    async def Init(self, request_iterator, context):
        with self._peer_slot(context):
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
            first, h = await reader.first_header()
            _check_header_fields(h)
            part = self.layouts.part(h.layout_epoch, h.partition)
            # who is asking, before a byte of the payload is read
            if not part.check_init_header(h.rank, h.trainer_id, h.fingerprint):
                return _pb.InitReply(version=part.version, accepted=False)
            values = await self._read_tensor(part, reader, first, h)
            accepted, version = await self.runtime.run_state(self._check_and_init, part, h, values)
            return _pb.InitReply(version=version, accepted=accepted)

    @_refusals
    async def Push(self, request_iterator, context):
        with self._peer_slot(context):
            _, r = await self._receive_push(request_iterator, context, stale_as_result=False)
            return _pb.PushReply(outcome=_OUTCOMES[r.outcome], version=r.version, staleness=r.staleness,
                                 layout_epoch=self.layouts.newest)

    @_refusals
    @_reply_stream
    async def PushPull(self, request_iterator, context: ReplyStream):
        """Push, then stream the weights of the version the trainer waits for next (see ps.proto)."""
        await self._push_pull(request_iterator, context)

    async def _push_pull(self, request_iterator, context, slot: bool = True) -> None:
        """PushPull's work (also a Step's dense part, whose call holds the rank's slot: ``slot`` False)."""
        h, r = await self._receive_push(request_iterator, context, stale_as_result=True, slot=slot)
        await self._pull_pushed(h, r, context)

    async def _receive_push(self, request_iterator, context, stale_as_result: bool, slot: bool = True):
        """Bound, identify, read and hand one pushed gradient to the shard: (header, PushResult)."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
        first, h = await reader.first_header()
        part = self._check_push_first(h)
        length = part.slice_length()
        async with (self._rank_slot(h.rank, h.partition) if slot else _no_slot()), \
                self.runtime.buffers.take(length) as held:
            grad = await self._read_tensor(part, reader, first, h, out=held.buffer, sparse=True)
            try:
                result, spare = await held.hand_over(self.runtime.run_state(self._check_and_push, part, h, grad))
            except StaleGradient as e:
                if not stale_as_result:
                    raise
                result = PushResult(STALE, e.version, e.staleness)  # counted by the shard; the reply catches up
            else:
                held.buffer = spare
        return h, result

    def _check_push_first(self, h: _pb.ChunkHeader) -> Shard:
        """A dense push's header, checked before a byte of its payload is read: the partition it names."""
        _check_header_fields(h)
        part = self.layouts.push_part(h.layout_epoch, h.partition, h.version)  # the layout first, then its fingerprint
        part.check_push_header(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples)
        check_stream_header(h, part.slice_length(), part.wire_dtype(), self.cfg.max_push_bytes)  # before allocating
        return part

    async def _read_tensor(self, part: Shard, reader: _StreamReader, first, h: _pb.ChunkHeader,
                           out: torch.Tensor | None = None, sparse: bool = False) -> torch.Tensor:
        """The stream's chunks, checked and copied (into ``out`` if given) as they arrive; finite-checked later.

        ``sparse`` (pushes): a header with topk > 0 is read as top-k pairs, bounded, and scattered into ``out``
        as a dense slice; elsewhere (Init) such a header is refused."""
        assembler = TopKAssembler if sparse and h.topk else ChunkAssembler
        asm = assembler(h, part.slice_length(), part.wire_dtype(), self.cfg.max_push_bytes,
                        out=out, min_chunk_bytes=self.cfg.min_chunk_bytes)
        chunk = first
        while chunk is not None:
            asm.add(chunk)
            chunk = await reader.next()
        values = asm.finish(require_finite=False)
        self.shard.count("bytes_in", asm.bytes_read)
        if h.topk and sparse:
            self.shard.count("topk_pushes")
        return values

    @staticmethod
    def _check_and_init(part: Shard, h: _pb.ChunkHeader, values: torch.Tensor):
        check_finite(values)
        return part.init(h.rank, h.trainer_id, h.fingerprint, values, True)

    def _check_and_push(self, part: Shard, h: _pb.ChunkHeader, grad: torch.Tensor):
        """On the state worker, in one hop: refuse NaN/Inf (--nonfinite refuse) or note them (skip), then push.

        One thread for all of a shard's tensor work: a second pool for the finite check cost a second hop per
        push and a second set of OpenMP threads spinning on the trainers' cores (ps-bench: -5 to -15% CNN).
        """
        if self.cfg.nonfinite == "refuse":
            check_finite(grad)
            finite = True
        else:
            finite = bool(torch.isfinite(grad).all())
        return part.push(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples, grad, h.sequence, finite,
                         leaving=h.leaving, claim=(h.claim, h.batches_per_epoch) if h.claim else None)

    # ------------------------------------------------------------------ streams out
    @_refusals
    @_reply_stream
    async def Pull(self, request, context: ReplyStream):
        request = _decoded(request)
        _check_identity(request)
        part = self.layouts.pull_part(request.layout_epoch, request.partition, request.min_version)
        wire = request.dtype or part.wire_dtype()
        if wire not in (_pb.FLOAT32, part.wire_dtype()):
            raise InvalidRequest(
                f"pull dtype is {wire} but this job sends {part.wire_dtype()} (or FLOAT32)")
        await self._stream_weights(part, request.rank, request.trainer_id, request.fingerprint,
                                   request.min_version, wire, context, partition=request.partition)

    async def _stream_weights(self, part: Shard, rank: int, trainer_id: str, fingerprint: str, min_version: int,
                              wire: int, context: ReplyStream, **reply_fields) -> None:
        """Wait (an awaited future, no thread) for ``min_version``, then stream the weights in chunks."""
        part.check_member(rank, trainer_id, fingerprint)
        loop = asyncio.get_running_loop()
        remaining = self._deadline(context) - loop.time()
        # Give up a little before the caller's deadline so it gets our reason, not a bare DEADLINE_EXCEEDED.
        timeout = min(max(0.0, remaining - 0.25), self.cfg.max_pull_wait)
        t0 = loop.time()
        if not await self.runtime.part_waiters(part).wait(min_version, timeout):
            raise WaitTimeout(part.pull_wait_message(min_version, timeout))
        waited = loop.time() - t0
        if self.runtime.stopping:
            raise ShuttingDown(f"shard {self.shard.shard_id} is shutting down")
        version, snapshot = await self.runtime.acquire_snapshot(part, rank, trainer_id, fingerprint, wire)
        try:
            nbytes = snapshot.numel() * snapshot.element_size()
            # One buffer however many pulls stream it: counted once for the shard (and once per connection).
            context.hold(("snapshot", snapshot.data_ptr(), nbytes), nbytes)
            self.shard.count("bytes_out", nbytes)
            header = _pb.ChunkHeader(dtype=wire, length=snapshot.numel(), version=version, wait_seconds=waited,
                                     membership_epoch=part.epoch_number(version), layout_epoch=self.layouts.newest,
                                     **reply_fields)
            for chunk in encode_raw(snapshot, header, self.cfg.chunk_bytes):
                await context.write(chunk, self.cfg.chunk_bytes)
        finally:
            part.release_snapshot(snapshot)

    # ------------------------------------------------------------------ sparse tables (psserver.sparse.calls)
    @_refusals
    @_reply_stream
    async def PullRows(self, request, context: ReplyStream):
        """The rows of unique ids of one table, in request order, once the table reached min_version."""
        request = _decoded(request)
        _check_identity(request)
        self.layouts.check_rows(request.layout_epoch, request.table, request.min_version, pull=True)
        self.shard.check_member(request.rank, request.trainer_id, request.fingerprint)
        self.shard.check_row_pull(request.rank, request.min_version)  # before a wait, and before any row is made
        table = self.shard.tables.get(request.table)
        ids = self.rows.pull_ids(request.ids, request.packed_ids)
        # the reply, before any row exists (and under the cap a trainer splits its pulls by)
        _check_pull_bytes(len(ids), table.spec.dim, min(self.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
        checked = await self.rows.check_ids(table, ids)  # before waiting: a refusal is not worth a wait
        waited, table, version, rows = await self.rows.pull(
            table, request.table, request.rank, request.trainer_id, request.fingerprint, request.min_version,
            checked, self._deadline(context), functools.partial(context.hold, ("rows", id(request))))
        header = _pb.RowsHeader(table=request.table, version=version, num_ids=len(ids), dim=table.spec.dim,
                                wait_seconds=waited)
        if request.remember:  # (ids once: a push may name this pull instead of resending its ids)
            header.pull_ref = self.rows.remember(request, checked)
        for chunk in row_chunks(rows, header, self.cfg.chunk_bytes):
            await context.write(chunk, self.cfg.chunk_bytes)

    @_refusals
    async def PushRows(self, request_iterator, context):
        """Summed gradient rows of unique ids for one table (see ps.proto and psserver.sparse.serving)."""
        with self._peer_slot(context):
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
            h, table, first = await self._rows_header(reader)
            r = await self._push_rows(reader, first, h, table)
            return _push_reply(r)

    @_refusals
    @_reply_stream
    async def PushPullRows(self, request_iterator, context: ReplyStream):
        """PushRows, then the rows of the header's ``pull_ids`` at the version the push leads to (PullRows'
        wait, bounds and gather), in one call: a sync step's push and its next batch's prefetch cross the wire
        once.  The pull ids are checked before the push, so a refused call changes nothing."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
        h, table, first = await self._rows_header(reader)
        checked = await self._check_pull_ids(h, table)
        await self._push_pull_rows(reader, first, h, table, checked, context)

    async def _check_pull_ids(self, h: _pb.RowsHeader, table):
        """A push-pull's ``pull_ids``, checked before the push (count, reply bytes, repeats, placement)."""
        ids = self.rows.pull_ids(h.pull_ids, h.packed_pull_ids, "pull_ids")
        _check_pull_bytes(len(ids), table.spec.dim, min(self.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
        return await self.rows.check_ids(table, ids)

    async def _push_pull_rows(self, reader, first, h: _pb.RowsHeader, table, checked, context,
                              slot: bool = True, read: tuple | None = None, pushed=None) -> None:
        """PushPullRows' work once its header and pull ids are checked (also a Step's table part, ``slot``
        False: the Step holds the rank's slot; ``read``: its rows, read and checked; ``pushed``: their ids'
        CheckedIds)."""
        r = await self._push_rows(reader, first, h, table, slot, read, pushed)
        ids = checked.ids
        min_version = reply_version(table.mode, r.outcome, h.version, r.version)
        waited, table, version, rows = await self.rows.pull(
            table, h.table, h.rank, h.trainer_id, h.fingerprint, min_version, checked, self._deadline(context),
            functools.partial(context.hold, ("rows", id(h))))
        self.shard.count("row_push_pulls")
        header = _pb.RowsHeader(table=h.table, version=version, num_ids=len(ids), dim=table.spec.dim,
                                wait_seconds=waited, push=_push_reply(r), pull_ref=self.rows.remember(h, checked))
        for chunk in row_chunks(rows, header, self.cfg.chunk_bytes):
            await context.write(chunk, self.cfg.chunk_bytes)

    # ------------------------------------------------------------------ a step in one call (psserver.step_parts)
    @_refusals
    @_reply_stream
    async def Step(self, request_iterator, context: ReplyStream):
        """A step's dense PushPull and table PushPullRows in one call (see ps.proto).  Every part's header, pull
        ids, row tiling and reply bytes are checked on the loop; then one trip to the state worker checks the
        tables' rows, decides the dense push, pushes the tables and pulls what is ready (psserver.step_trip) --
        so a refusal before the dense push changes nothing -- and the replies stream side by side."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
        parts = await self._step_parts(reader)
        dense = next((p for p in parts if p.kind == DENSE), None)
        if dense is not None:
            self._check_push_first(dense.header)
        deadline = self._deadline(context)
        tables = [(p.index, await self._step_table(p, deadline, context)) for p in parts if p.kind == ROWS]
        self.shard.count("step_calls")
        turn = asyncio.Lock()
        async with self._rank_slot(parts[0].header.rank):
            pushed = await self._step_trip(dense, [t for _, t in tables], context)
            runs = [] if dense is None else [self._pull_pushed(*pushed, _PartStream(context, dense.index, turn))]
            runs += [self._step_table_reply(t, _PartStream(context, index, turn), deadline) for index, t in tables]
            await _first_error(runs)

    async def _step_parts(self, reader: _StreamReader) -> list:
        """A Step's parts, each part's header checked as it arrives (a member, one caller, the sizes it declares
        bounded) and the rest read holding a call of part 0's rank: a stranger, a part over its bounds or a
        stream held open is refused, or counted against --max-calls-per-rank, before it is read whole."""
        collected = StepParts(self.cfg.max_push_bytes, min_chunk_bytes=self.cfg.min_chunk_bytes)
        async with AsyncExitStack() as held:
            while (msg := await reader.next()) is not None:
                seen = len(collected.parts)
                collected.add(msg)
                for p in collected.parts[seen:]:
                    self._check_step_header(p, collected.parts[0])
                    if p.index == 0:
                        await held.enter_async_context(self._rank_slot(p.header.rank))
        return collected.finish()

    def _check_step_header(self, p, first) -> None:
        """A Step part's header as its first chunk arrives: what its own RPC checks before reading a payload."""
        h = check_caller(p, first)
        if p.kind == ROWS:
            self._check_rows_first(h)
            return
        _check_header_fields(h)
        part = self.layouts.push_part(h.layout_epoch, h.partition, h.version)  # the layout first, as Push does
        part.check_member(h.rank, h.trainer_id, h.fingerprint)
        check_stream_header(h, part.slice_length(), part.wire_dtype(), self.cfg.max_push_bytes)

    async def _step_table(self, p, deadline: float, context) -> TablePart:
        """A Step's table part read and bounded on the loop (header, the wait for an open round, pull ids and the
        reply's bytes, held now, row tiling): its TablePart, for the trip to check and apply."""
        first, h = p.chunks[0], p.header
        table = self._check_rows_first(h)
        table = await self.rows.wait_push_base(table, h.table, h.rank, h.version, deadline)  # before check_push
        pull_ids = None
        if h.pull_ids or h.packed_pull_ids:
            pull_ids = self.rows.pull_ids(h.pull_ids, h.packed_pull_ids, "pull_ids")
            _check_pull_bytes(len(pull_ids), table.spec.dim,
                              min(self.cfg.max_push_bytes, limits.MAX_ROWS_REPLY_BYTES))
            context.hold(("rows", id(h)), len(pull_ids) * table.spec.dim * 4)  # before any row is made
        ids, grads = await self._read_rows(
            _StreamReader(_replay(p.chunks[1:]), self.cfg.stream_idle_timeout, deadline), first, h)
        push = RowsPush(h.rank, h.trainer_id, h.version, h.num_samples, h.sequence, ids, grads)
        return TablePart(h, table, push, pull_ids)

    async def _step_trip(self, dense, tables: list[TablePart], context):
        """The Step's dense gradient read into a receive buffer, then its one trip (run_trip): the dense part's
        (header, PushResult) -- a stale push as a result, as PushPull answers it -- or None without one."""
        refuse = self.cfg.nonfinite == "refuse"

        def trip(push=None):
            return run_trip(self.shard, tables, refuse, push, lambda: self.runtime.stopping)

        if dense is None:
            await self.rows.run_all([(t.table, t.elements) for t in tables], trip)
            return None
        reader = _StreamReader(_replay(dense.chunks), self.cfg.stream_idle_timeout, self._deadline(context))
        first, h = await reader.first_header()
        part = self._check_push_first(h)
        async with self.runtime.buffers.take(part.slice_length()) as held:
            grad = await self._read_tensor(part, reader, first, h, out=held.buffer, sparse=True)
            out = await held.hand_over(self.rows.run_all(
                [(t.table, t.elements) for t in tables], trip,
                functools.partial(_stale_as_result, self._check_and_push, part, h, grad)))
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
            await context.write(_pb.RowsChunk(header=_pb.RowsHeader(table=h.table, dim=h.dim,
                                                                    push=_push_reply(t.result))))
            return
        waited, table = 0.0, t.table
        if t.pulled is not None:
            version, rows = t.pulled
        else:
            min_version = reply_version(table.mode, t.result.outcome, h.version, t.result.version)
            waited, table, version, rows = await self.rows.pull(
                table, h.table, h.rank, h.trainer_id, h.fingerprint, min_version, t.checked, deadline,
                lambda _nbytes: None)  # held before the trip
        self.shard.count("row_push_pulls")
        header = _pb.RowsHeader(table=h.table, version=version, num_ids=len(t.checked.ids), dim=table.spec.dim,
                                wait_seconds=waited, push=_push_reply(t.result),
                                pull_ref=self.rows.remember(h, t.checked))  # (ids once, as PushPullRows)
        for chunk in row_chunks(rows, header, self.cfg.chunk_bytes):
            await context.write(chunk, self.cfg.chunk_bytes)

    async def _pull_pushed(self, h: _pb.ChunkHeader, r, context) -> None:
        """A pushed dense gradient's reply: the weights of the version to go on from (PushPull's second half)."""
        part = self.layouts.part(h.layout_epoch, h.partition)
        wanted = modes.reply_version(part.mode_config(), r.outcome, h.version, r.version)
        await self._stream_weights(part, h.rank, h.trainer_id, h.fingerprint, wanted, part.wire_dtype(),
                                   context, outcome=_OUTCOMES[r.outcome], staleness=r.staleness,
                                   partition=h.partition, **_claim_answer(part, h))

    async def _rows_header(self, reader: _StreamReader):
        """A row push's first chunk: who is asking and what they declare, before a byte of the payload is read."""
        first = _decoded(await reader.next() or _Undecodable(ValueError("the stream is empty")))
        if not first.HasField("header"):
            raise InvalidRequest("the first chunk has no header")
        h = first.header
        table = self._check_rows_first(h)
        # a sync push one round ahead from a trainer in the open round waits for its close (psserver.sparse.calls)
        table = await self.rows.wait_push_base(table, h.table, h.rank, h.version, reader.deadline)
        return h, table, first

    def _check_rows_first(self, h: _pb.RowsHeader):
        """A row push's header: the caller a member, the table known, the declared sizes bounded; the table."""
        _check_header_fields(h)
        self.layouts.check_rows(h.layout_epoch, h.table, h.version)
        self.shard.check_member(h.rank, h.trainer_id, h.fingerprint)
        table = self.shard.tables.get(h.table)
        _check_rows_declared(h, table.spec.dim, self.cfg.max_push_bytes)
        return table

    async def _push_rows(self, reader: _StreamReader, first, h: _pb.RowsHeader, table, slot: bool = True,
                         read: tuple | None = None, pushed=None):
        """Read the push's rows and hand it to the table's executor (psserver.sparse.serving): its RowsResult.
        ``read``: the (ids, grads) a Step's check already read, ``pushed``: its ids as checked (CheckedIds)."""
        async with self._rank_slot(h.rank) if slot else _no_slot():
            ids, grads = read if read is not None else await self._read_rows(reader, first, h)
            push = RowsPush(h.rank, h.trainer_id, h.version, h.num_samples, h.sequence, ids, grads)
            try:
                return await self.rows.run(table, grads.numel(), self.shard.push_rows, h.fingerprint, h.table,
                                           push, self.cfg.nonfinite == "refuse", pushed)
            except StaleGradient:
                self.shard.count("row_pushes_stale")
                raise

    async def _read_rows(self, reader: _StreamReader, first, h: _pb.RowsHeader) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream's ids and rows, checked chunk by chunk as they arrive (tiling, sizes) and copied."""
        n, dim = h.num_ids, h.dim
        named = self.rows.push_ids(h)  # the ids of the pulls the push names (ids once), or None: in the chunks
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
        if pos != n:
            raise InvalidRequest(f"the chunks cover ids [0, {pos}) but num_ids is {n}")
        self.shard.count("bytes_in", n * (4 * dim + (8 if named is None else 0)))
        return ids, grads


class _PartStream:
    """A Step part's reply stream: its messages go out as StepChunks of its number, through the call's
    ReplyStream (whose deadline and held bytes bound them all), one part's write at a time (``turn``, the
    call's); anything else is the call's."""

    def __init__(self, stream: ReplyStream, index: int, turn: asyncio.Lock):
        self._stream, self._index, self._turn = stream, index, turn

    def __getattr__(self, name):
        return getattr(self._stream, name)

    async def write(self, message, nbytes: int = 0) -> None:
        wrapped = StepMessage(part=self._index, rows=message) if isinstance(message, _pb.RowsChunk) else \
            StepMessage(part=self._index, dense=message)
        async with self._turn:  # gRPC takes one write at a time on a call
            await self._stream.write(wrapped, nbytes)


REPLAY_SLICE_BYTES = 4 << 20  # a replayed part hands the event loop back after this many bytes of its chunks


async def _replay(chunks):
    """A part's chunks, already received, as the request stream its RPC's handler reads -- handing the event loop
    back every REPLAY_SLICE_BYTES: its reader copies each chunk on the loop, and a part received whole was copied
    in one go (0.7 s of a loop stall for a table part of 10**6 rows of dim 64; heartbeats and health checks wait)."""
    since = 0
    for chunk in chunks:
        yield chunk
        since += len(chunk.data) if hasattr(chunk, "data") else len(chunk.ids) + len(chunk.rows)
        if since >= REPLAY_SLICE_BYTES:
            since = 0
            await asyncio.sleep(0)


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


@asynccontextmanager
async def _no_slot():
    """In place of a rank slot a Step's part does not take (the Step holds one for all its parts)."""
    yield


def _push_reply(r) -> _pb.PushRowsReply:
    return _pb.PushRowsReply(outcome=_OUTCOMES[r.outcome], version=r.version, staleness=r.staleness,
                             rows_applied=r.rows_applied, rows_stale=r.rows_stale)


def _check_pull_bytes(n: int, dim: int, max_bytes: int) -> None:
    """Refuse a row pull whose reply (and the rows it may create) would pass the shard's per-call byte limit
    (limits.MAX_ROWS_REPLY_BYTES, or --max-push-bytes if lower)."""
    if n * dim * 4 > max_bytes:
        raise TooLarge(f"the pull asks for {n} rows of dim {dim} ({n * dim * 4} bytes), over this shard's limit "
                       f"of {max_bytes} bytes for one PullRows reply: split the ids")


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




def add_service(servicer: ParameterServerService, server) -> None:
    """Register the servicer like the generated ``add_ParameterServerServicer_to_server``, except that
    Chunk streams use psserver.protocol.fastwire (same bytes on the wire, fewer copies) and undecodable unary
    requests reach the handler (to be refused as INVALID_ARGUMENT, not INTERNAL)."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Register": unary(servicer.Register, _safe(_pb.RegisterRequest.FromString),
                          _pb.RegisterReply.SerializeToString),
        "Init": grpc.stream_unary_rpc_method_handler(servicer.Init, parse_chunk, _pb.InitReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, _safe(_pb.PullRequest.FromString), serialize_chunk),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, parse_chunk, _pb.PushReply.SerializeToString),
        "PushPull": grpc.stream_stream_rpc_method_handler(servicer.PushPull, parse_chunk, serialize_chunk),
        "Leave": unary(servicer.Leave, _safe(_pb.LeaveRequest.FromString), _pb.LeaveReply.SerializeToString),
        "Heartbeat": unary(servicer.Heartbeat, _safe(_pb.HeartbeatRequest.FromString),
                           _pb.HeartbeatReply.SerializeToString),
        "ClaimBatch": unary(servicer.ClaimBatch, _safe(_pb.ClaimRequest.FromString), _pb.ClaimReply.SerializeToString),
        "GetStats": unary(servicer.GetStats, _safe(_pb.StatsRequest.FromString), _pb.StatsReply.SerializeToString),
        "PullRows": grpc.unary_stream_rpc_method_handler(servicer.PullRows, _safe(_pb.PullRowsRequest.FromString),
                                                         _pb.RowsChunk.SerializeToString),
        "PushRows": grpc.stream_unary_rpc_method_handler(servicer.PushRows, _safe(_pb.RowsChunk.FromString),
                                                         _pb.PushRowsReply.SerializeToString),
        "PushPullRows": grpc.stream_stream_rpc_method_handler(
            servicer.PushPullRows, _safe(_pb.RowsChunk.FromString), _pb.RowsChunk.SerializeToString),
        "Step": grpc.stream_stream_rpc_method_handler(servicer.Step, parse_step, serialize_step),
        "Reshard": unary(servicer.Reshard, _safe(_pb.ReshardRequest.FromString), _pb.ReshardReply.SerializeToString),
        "Handoff": grpc.stream_unary_rpc_method_handler(servicer.Handoff, _safe(_pb.HandoffChunk.FromString),
                                                        _pb.HandoffAck.SerializeToString),
    }
    missing = set(stubs.METHODS) - set(handlers)
    if missing:
        raise RuntimeError(f"protos/ defines RPCs this server does not register: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(stubs.SERVICE_NAME, handlers),))
