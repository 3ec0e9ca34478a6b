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

The handlers live in rooms by RPC family, mixed into one servicer: the dense, membership and admin RPCs here;
the table RPCs in psserver.serving.service_rows; Step in psserver.serving.service_step (which reuses the other handlers' halves on
its parts); what they share -- the stream reader, the refusal wrapper, the header checks -- in
psserver.serving.service_common.  The rule that errors become status codes in one place holds across them: every
handler is wrapped by ``_refusals``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
import torch

from psserver.common.logsafe import RateLimitedLog, counted
from psserver.partition.host import ShardHost
from psserver.partition.shard import PushResult, Shard
from psserver.protocol import admin_token, limits, stubs
from psserver.protocol.codec import (
    DEFAULT_CHUNK_BYTES,
    ChunkAssembler,
    TopKAssembler,
    check_finite,
    check_stream_header,
    encode_raw,
)
from psserver.protocol.errors import (
    HandoffPending,
    InvalidRequest,
    NotPermitted,
    NotReady,
    ShuttingDown,
    StaleGradient,
    TooBusy,
    WaitTimeout,
)
from psserver.protocol.fastwire import parse_chunk, parse_rows_chunk, serialize_chunk, serialize_rows_chunk
from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import STALE
from psserver.protocol.stepwire import parse_step, serialize_step
from psserver.resharding.layout_host import LayoutHost
from psserver.serving.digest_gate import DigestGate
from psserver.serving.replies import Connections, ReplyLedger, ReplyStream, RequestLedger
from psserver.serving.runtime import Runtime
from psserver.serving.service_common import (
    _OUTCOMES,
    StreamEndedEarly,
    _check_header_fields,
    _check_identity,
    _decoded,
    _is_loopback,
    _is_member,
    _no_slot,
    _read_all,
    _refusals,
    _reply_stream,
    _safe,
    _StreamReader,
    peer_host,
)
from psserver.serving.service_rows import RowRpcs
from psserver.serving.service_step import StepRpc
from psserver.serving.step_engine import StepEngine
from psserver.sparse.calls import RowCalls

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ServiceLimits:
    """What one caller may hold of a shard (flags of ps-server; see ServerConfig)."""

    max_push_bytes: int = 4 << 30  # one Init/Push stream
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # chunks of the streams this shard sends
    max_message_bytes: int = 16 << 20  # gRPC's send limit (ServerConfig's): a packed Step reply stays under half
    max_pull_wait: float = 600.0  # longest a pull waits for a version
    stream_idle_timeout: float = 30.0  # a stream that sends nothing this long is ended
    max_call_seconds: float = 900.0  # no call lives longer, whatever deadline its client set
    max_calls_per_peer: int = 64  # data calls (and health Watch streams) in flight on one connection
    max_connections: int = 4096  # connections with calls in flight (MAX_TRAINERS: one connection per trainer)
    max_watch_streams: int = 64  # health Watch streams open on the main port
    max_reply_bytes_per_peer: int = 256 << 20  # bytes of unread replies one connection may hold (one always)
    max_reply_bytes: int = 1 << 30  # bytes of unread replies the shard may hold (one reply always)
    max_request_bytes_per_peer: int = 1 << 30  # bytes of requests being received one connection may hold (one always)
    max_request_bytes: int = 2 << 30  # bytes of requests being received the shard may hold (one request always)
    max_calls_per_rank: int = limits.MAX_CALLS_PER_RANK  # data calls in flight naming one rank
    min_chunk_bytes: int = limits.MIN_CHUNK_BYTES  # every chunk of a stream but the last carries at least this
    receive_buffers: int = 8  # slice-sized receive buffers at least (more while they fit in 256 MB); pushes beyond
    # wait, their bytes held back by gRPC's flow control
    nonfinite: str = "refuse"  # NaN/Inf gradients: "refuse" (INVALID_ARGUMENT) or "skip" (counted, not applied)
    step_engine: bool = True  # a caller's steady-state StepOnce through psserver.serving.step_engine (--no-step-engine)

    def __post_init__(self) -> None:
        if self.nonfinite not in ("refuse", "skip"):
            raise ValueError(f"The non-finite policy ({self.nonfinite!r}) must be 'refuse' or 'skip'.")
        for name in ("stream_idle_timeout", "max_call_seconds", "max_pull_wait"):
            value = getattr(self, name)
            if not 0 < value <= limits.MAX_SYNC_TIMEOUT:
                raise ValueError(f"The {name.replace('_', ' ')} ({value} s) must be between 0 and "
                                 f"{limits.MAX_SYNC_TIMEOUT:.0f} seconds.")
        for name in ("max_calls_per_peer", "max_calls_per_rank", "receive_buffers", "max_connections",
                     "max_watch_streams", "max_reply_bytes_per_peer", "max_reply_bytes",
                     "max_request_bytes_per_peer", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"The {name.replace('_', ' ')} ({getattr(self, name)}) must be at least 1.")


class ParameterServerService(RowRpcs, StepRpc):
    def __init__(self, host: ShardHost, runtime: Runtime, cfg: ServiceLimits = ServiceLimits(),
                 authenticated: bool = False, connections: Connections | None = None,
                 replies: ReplyLedger | None = None, layouts: LayoutHost | None = None, handoffs=None,
                 requests: RequestLedger | None = None, admin_token: str = ""):
        # Dense calls go to the partition of the layout they name (psserver.resharding.layout_host, psserver.partition.host); layout 0's
        # sparse tables are its partition 0's, ``self.shard``.  What the servicer counts (refusals, bytes, calls,
        # cancellations) is shard-wide, ``count`` (psserver.state.stats.WideCounts, every layout's host's): GetStats and
        # metrics read the newest layout's host, and a count made before a switch stays in them after it.
        # ``authenticated``: every caller proved itself before reaching here (a token or mutual TLS), so members-only
        # answers need no membership.
        self.layouts, self.shard, self.runtime, self.cfg = layouts or LayoutHost(host), host.head, runtime, cfg
        self.count = host.wide.count
        self.authenticated = authenticated
        self.admin_token = admin_token  # set: a Reshard (but STATUS) needs it (psserver.protocol.admin_token)
        self.refusal_log = RateLimitedLog(log)
        # Calls per connection and connections (shared with the health service's Watch streams), and the bytes
        # unread replies hold (psserver.serving.replies; made by psserver.serving.server.build_shard_process, which reads them).
        self.connections = connections or Connections(cfg.max_calls_per_peer, cfg.max_connections,
                                                      cfg.max_watch_streams, self.count)
        self.replies = replies or ReplyLedger(cfg.max_reply_bytes_per_peer, cfg.max_reply_bytes)
        self.requests = requests or RequestLedger(cfg.max_request_bytes_per_peer, cfg.max_request_bytes)
        self._per_rank: dict[tuple[int, int], int] = {}  # (rank, partition) -> calls in flight
        self.rows = RowCalls(self.shard, runtime, cfg.max_pull_wait)  # the row calls' table steps (layout 0's)
        self._rows_by_epoch: dict[int, RowCalls] = {}  # a later layout's (RowRpcs.rows_at)
        self.replication = None  # a hot standby's shipper when this replica is primary (psserver.replication)
        self.handoffs = handoffs  # a live re-shard's Reshard and Handoff calls (psserver.resharding.handoff_io)
        self.digests = DigestGate(runtime.offload)  # GetStats' state digests, one pass at a time per partition
        self._spec_turn = asyncio.Lock()  # one big job spec read at a time (_job_of)
        self.engine = StepEngine(self) if cfg.step_engine else None  # StepOnce's steady state (psserver.serving.step_engine)

    @property
    def host(self) -> ShardHost:
        return self.layouts.current  # the newest layout's: Register, Leave, Heartbeat, ClaimBatch, GetStats

    # ------------------------------------------------------------------ limits
    @asynccontextmanager
    async def _slot(self, table: dict, key, limit: int, what: str):
        if table.get(key, 0) >= limit:
            self.count("refused_over_limit")
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

    def rank_calls(self, rank: int, partition: int = 0) -> int:
        """Calls naming ``rank`` (on ``partition``) in flight now: what ``_rank_slot`` bounds."""
        return self._per_rank.get((rank, partition), 0)

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
        job = await self._job_of(request.job, context)
        if request.join and not request.join_round:
            self._check_no_open_plan()
        part = self.layouts.register_host(request.layout_epoch, job.fingerprint).part_for_register(
            request.partition, request.rank, request.expected_shard, job, request.join)
        r = await self.runtime.run_state(part.register, request.rank, request.trainer_id,
                                         request.expected_shard, job, request.join, request.join_round,
                                         request.join_confirm, peer_host(context.peer() or ""))
        return _pb.RegisterReply(**r, layout_epoch=self.layouts.newest)

    async def _job_of(self, proto: _pb.JobSpec, context) -> JobSpec:
        """A Register's job spec, read (and every field bounded) by JobSpec.from_proto: Python a tensor, ~1 s for
        60,000 tensors (limits.MAX_TENSORS is 65,536), and Register is open to anyone who reaches the port.  A spec
        of more than BIG_SPEC_TENSORS is read on a thread, one at a time, holding a call of its connection: the
        loop answers heartbeats and health checks meanwhile (docs/design/attacks-2026-11-25.md).  The call and the turn
        are held until the thread's read ends, not until the caller stops waiting: a cancelled call's read goes on
        (a thread cannot be stopped), and a client that sent and cancelled in a loop queued reads without bound."""
        if len(proto.tensors) <= BIG_SPEC_TENSORS:
            return _parse_job(proto)
        with ExitStack() as held:
            held.enter_context(self._peer_slot(context))
            await self._spec_turn.acquire()
            held.callback(self._spec_turn.release)
            read = asyncio.get_running_loop().run_in_executor(None, _parse_job, proto)
            read.add_done_callback(functools.partial(_close, held.pop_all()))  # when the thread is done
        return await asyncio.shield(read)  # a cancel ends the call, not the read (nor what it holds)

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
        version, live = self.layouts.heartbeat(request.partition, request.rank, request.trainer_id,
                                               request.fingerprint)
        return _pb.HeartbeatReply(version=version, live=live, layout_epoch=self.layouts.newest)

    @_refusals
    async def ClaimBatch(self, request, context):
        """The job's data cursor (psserver.members.data_cursor): the next batch of an async or stale-timeout trainer."""
        request = _decoded(request)
        _check_identity(request)
        grant = await self.runtime.run_state(self.host.part(0).dense_pushes.claim_batch, request.rank, request.trainer_id,
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
                               epochs=part.admission.epoch_timeline_proto(request.members_from_round))
        if s.job is not None and (self.authenticated or _is_member(part, request)):
            reply.job.CopyFrom(s.job.to_proto())
        if self.authenticated or any(_is_member(head, request) for head in self.layouts.heads()) or \
                self.layouts.was_member(request.rank, request.trainer_id, request.fingerprint):
            reply.layouts.extend(self.layouts.timeline_proto())  # fingerprints: for a member of any layout
        reply.drained = self.layouts.drained  # "tombstone" or "retired" (docs/design/handoff-io.md: when it may be stopped)
        if self.handoffs is not None:
            reply.handoffs.extend(await self.handoffs.records_off_loop())
        return reply

    @_refusals
    async def Reshard(self, request, context):
        """A live re-shard's coordinator call (psserver.resharding.handoff_io); any op but STATUS changes the job's layout,
        so it is taken only from a caller the shard trusts (``_check_reshard_peer``)."""
        request = _decoded(request)
        if request.op != _pb.ReshardRequest.STATUS:
            self._check_reshard_peer(context, "Reshard")
            self._check_admin_token(context, request)
            if self.replication is not None:
                raise NotReady(f"op {_pb.ReshardRequest.Op.Name(request.op)} refused: shard {self.shard.shard_id} "
                               f"runs with a hot standby (--etcd), and a job with standbys cannot be re-sharded live "
                               f"yet (docs/standby.md)")
        try:
            return await self._handoffs().reshard(request)
        finally:
            self.drop_freed_rows()  # after RETIRE: the freed layouts' row calls go too

    @_refusals
    async def Handoff(self, request_iterator, context):
        """A live re-shard's source streaming to this destination (psserver.resharding.handoff_io), read with the idle and
        total deadlines of every stream: a stream left open holds its bytes and a call of its connection."""
        with self._peer_slot(context):
            self._check_reshard_peer(context, "Handoff")
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
            return await self._handoffs().handoff(_read_all(reader))

    def _check_no_open_plan(self) -> None:
        """A join's admission waits out a live re-shard (UNAVAILABLE, reason ``handoff``; the joiner asks again):
        admitted between PREPARE and DECIDE, its epoch would be mixed into moves copied without it."""
        handoffs = self.handoffs
        plan = handoffs.plan if handoffs is not None else None
        if plan is not None and not handoffs.settled():
            raise HandoffPending(f"join is set but this shard is re-sharding under plan {plan.id!r} (not switched or "
                                 "aborted yet): a join is admitted after the hand-off; asked again, it is")

    def _check_reshard_peer(self, context, what: str) -> None:
        """A shard that authenticates no caller (no token, no mutual TLS) takes a re-shard's calls only from its
        own host: the plan id is derived from the addresses and the records are public, so without this any peer
        that reaches the port could stall, abort or redirect the job's hand-off (docs/design/attacks-2026-11-24.md)."""
        peer = context.peer() or ""
        if not self.authenticated and not _is_loopback(peer):
            raise NotPermitted(f"peer is {peer!r} but this shard authenticates no caller and takes {what} only from "
                               "its own host (loopback): give the shards --auth-token-file (or mutual TLS) to "
                               "re-shard across hosts")

    def _check_admin_token(self, context, request) -> None:
        """A shard with an admin token takes a re-shard's changes only from a caller that sends it: without it,
        any process that reaches the port -- on loopback, any local program -- could copy the job's state away or
        freeze the job (issue 35 item 7, docs/security.md)."""
        if not self.admin_token:
            return
        given = admin_token.presented(context)
        if not admin_token.matches(given, self.admin_token):
            op = _pb.ReshardRequest.Op.Name(request.op)
            raise NotPermitted(f"{admin_token.METADATA_KEY} is {'wrong' if given else 'missing'}"
                               f" but this shard takes Reshard {op} only with its admin token: run ps-server reshard "
                               "as the user who started the shards (it reads the token each shard wrote at start), "
                               f"or give both --admin-token-file (or ${admin_token.ADMIN_TOKEN_ENV})")

    def _handoffs(self):
        if self.handoffs is None:
            raise NotReady("handoffs is None but a live re-shard needs a shard process (psserver.serving.server)")
        return self.handoffs

    def _digest(self, part: Shard, request):
        """The partition's state digest, for members (or any caller of a shard that authenticates them all),
        hashed on the state worker: a pass over a big table took seconds, and on the loop it held every
        heartbeat and health check that long.  One pass at a time, shared by the callers waiting for it
        (psserver.serving.digest_gate): many callers cost the worker no more than one."""
        if not self.authenticated:
            _check_identity(request)
            part.admission.check_digest_caller(request.rank, request.trainer_id, request.fingerprint)
        return self.digests.digest(part)

    # ------------------------------------------------------------------ streams in
    @_refusals
    async def Init(self, request_iterator, context):
        with self._peer_slot(context):
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
            first, h = await reader.first_header()
            _check_header_fields(h)
            part = self.layouts.part(h.layout_epoch, h.partition)
            # who is asking, before a byte of the payload is read
            if not part.pulls.check_init_header(h.rank, h.trainer_id, h.fingerprint):
                return _pb.InitReply(version=part.version, accepted=False)
            values = await self._read_tensor(part, reader, first, h)
            accepted, version = await self.runtime.run_state(self._check_and_init, part, h, values)
            return _pb.InitReply(version=version, accepted=accepted)

    @_refusals
    async def Push(self, request_iterator, context):
        with self._peer_slot(context):
            h, r = await self._receive_push(request_iterator, context, stale_as_result=False)
            part = self.layouts.part(h.layout_epoch, h.partition)
            if self.runtime.holds.held(part, r.version) is not None:  # a reply naming R waits for DECIDE
                await self.runtime.holds.wait(part, r.version, self._deadline(context) - 0.25)
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
        _check_header_fields(h)  # (a question for an old slot too: its ids and numbers bounded as every push's)
        if h.moved_from:  # a question for an old slot that could not be reached (psserver.resharding.moved_books)
            return h, await self._moved_push(h, stale_as_result)
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
        part.dense_pushes.check_push_header(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples)
        check_stream_header(h, part.slice_length(), part.wire_dtype(), self.cfg.max_push_bytes)  # before allocating
        return part

    async def _moved_push(self, h: _pb.ChunkHeader, stale_as_result: bool) -> PushResult:
        try:
            return await self.runtime.run_state(self._handoffs().moved_push, h)
        except StaleGradient as e:
            if not stale_as_result:
                raise
            return PushResult(STALE, e.version, e.staleness)

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
        if isinstance(asm, ChunkAssembler) and asm.pos < asm.length:  # the stream ended before its chunks were whole
            raise StreamEndedEarly(f"the chunks cover [0, {asm.pos}) but the slice is [0, {asm.length})")
        values = asm.finish(require_finite=False)
        self.count("bytes_in", asm.bytes_read)
        if h.topk and sparse:
            self.count("topk_pushes")
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
            raise WaitTimeout(part.pulls.pull_wait_message(min_version, timeout))
        if self.runtime.holds.held(part, part.version) is not None:  # version R waits for DECIDE (reply_holds)
            await self.runtime.holds.wait(part, part.version, t0 + timeout)
        waited = loop.time() - t0
        if self.runtime.stopping:
            raise ShuttingDown(f"shard {self.shard.shard_id} is shutting down")
        version, snapshot = await self.runtime.acquire_snapshot(part, rank, trainer_id, fingerprint, wire)
        try:
            nbytes = snapshot.numel() * snapshot.element_size()
            # One buffer however many pulls stream it: counted once for the shard (and once per connection).
            context.hold(("snapshot", snapshot.data_ptr(), nbytes), nbytes)
            self.count("bytes_out", nbytes)
            header = _pb.ChunkHeader(dtype=wire, length=snapshot.numel(), version=version, wait_seconds=waited,
                                     membership_epoch=part.admission.epoch_number(version), layout_epoch=self.layouts.newest,
                                     **reply_fields)
            for chunk in encode_raw(snapshot, header, self.cfg.chunk_bytes):
                await context.write(chunk, self.cfg.chunk_bytes)
        finally:
            part.pulls.release_snapshot(snapshot)

    # ------------------------------------------------------------------ sparse tables (psserver.sparse.calls)
BIG_SPEC_TENSORS = 1024  # a Register's job spec of more tensors is read off the event loop (_job_of)


def _close(held: ExitStack, _read: asyncio.Future) -> None:
    """A big spec's read ended (on the loop): give back its connection's call and the turn."""
    held.close()


def _parse_job(proto: _pb.JobSpec) -> JobSpec:
    try:
        return JobSpec.from_proto(proto)
    except ValueError as e:
        raise InvalidRequest(f"job spec: {e}") from None


def _step_request_parser():
    """Step's request parser: its ``more`` bounded (limits.MAX_STEP_MESSAGE_CHUNKS) as it is parsed on the loop."""
    parse = parse_step  # (the one in effect when the shard adds its service)
    return lambda message: parse(message, max_more=limits.MAX_STEP_MESSAGE_CHUNKS)


def add_service(servicer: ParameterServerService, server) -> None:
    """Register the servicer like the generated ``add_ParameterServerServicer_to_server``, except that
    Chunk streams use psserver.protocol.fastwire (same bytes on the wire, fewer copies) and undecodable unary
    requests reach the handler (to be refused as INVALID_ARGUMENT, not INTERNAL)."""
    unary = grpc.unary_unary_rpc_method_handler
    parse_step_request = _step_request_parser()
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
                                                         serialize_rows_chunk),
        "PushRows": grpc.stream_unary_rpc_method_handler(servicer.PushRows, _safe(parse_rows_chunk),
                                                         _pb.PushRowsReply.SerializeToString),
        "PushPullRows": grpc.stream_stream_rpc_method_handler(
            servicer.PushPullRows, _safe(parse_rows_chunk), serialize_rows_chunk),
        "Step": grpc.stream_stream_rpc_method_handler(servicer.Step, parse_step_request, serialize_step),
        "StepOnce": unary(servicer.StepOnce, parse_step_request, serialize_step),
        "Reshard": unary(servicer.Reshard, _safe(_pb.ReshardRequest.FromString), _pb.ReshardReply.SerializeToString),
        "Handoff": grpc.stream_unary_rpc_method_handler(servicer.Handoff, _safe(_pb.HandoffChunk.FromString),
                                                        _pb.HandoffAck.SerializeToString),
    }
    missing = set(stubs.METHODS) - set(handlers)
    if missing:
        raise RuntimeError(f"protos/ defines RPCs this server does not register: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(stubs.SERVICE_NAME, handlers),))
