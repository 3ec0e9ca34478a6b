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

Every RPC's handler is here, and each decodes, calls one method, encodes and maps errors.  The membership and admin
RPCs call the shard, the host or the layouts; the others call a room by RPC family, an object the servicer makes
and hands what it calls (no mixins): the dense RPCs' halves in psserver.serving.service_dense, the table RPCs' in
psserver.serving.service_rows, Step's in psserver.serving.service_step (which reuses the other rooms' halves on its
parts), the calls in flight per connection and rank and each call's deadline in psserver.serving.call_slots; what
they share -- the stream reader, the refusal wrapper, the header checks -- in psserver.serving.service_common.  The
rule that errors become status codes in one place holds: every handler is wrapped by ``_refusals``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import ExitStack
from dataclasses import dataclass

import grpc

from psserver.common.logsafe import RateLimitedLog
from psserver.partition.host import ShardHost
from psserver.partition.shard import Shard
from psserver.protocol import admin_token, limits, stubs
from psserver.protocol.codec import DEFAULT_CHUNK_BYTES
from psserver.protocol.errors import HandoffPending, InvalidRequest, NotPermitted, NotReady
from psserver.protocol.fastwire import parse_chunk, parse_rows_chunk, serialize_chunk, serialize_rows_chunk
from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.stepwire import parse_step, serialize_step
from psserver.resharding.layout_host import LayoutHost
from psserver.serving.call_slots import CallSlots
from psserver.serving.digest_gate import DigestGate
from psserver.serving.replies import Connections, ReplyLedger, ReplyStream, RequestLedger
from psserver.serving.runtime import Runtime
from psserver.serving.service_common import (
    _check_identity,
    _decoded,
    _is_loopback,
    _is_member,
    _read_all,
    _refusals,
    _reply_stream,
    _safe,
    _StreamReader,
    peer_host,
    require_handoffs,
)
from psserver.serving.service_dense import DenseRpcs
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


class ParameterServerService:
    """The servicer: each handler decodes (or hands its stream to the room that reads it), calls one method of the
    shard, the host or a room, encodes, and maps errors (``_refusals``).  Its rooms are objects it makes and hands
    what they call: the call slots (psserver.serving.call_slots), the dense RPCs' halves (``dense``,
    psserver.serving.service_dense), the table RPCs' (``tables``, psserver.serving.service_rows) and Step's
    (``steps``, psserver.serving.service_step)."""

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
        self.slots = CallSlots(cfg, self.connections, self.count)  # calls per connection and rank, deadlines
        self.replication = None  # a hot standby's shipper when this replica is primary (psserver.replication)
        self.handoffs = handoffs  # a live re-shard's Reshard and Handoff calls (psserver.resharding.handoff.shard_ops)
        self.digests = DigestGate(runtime.offload)  # GetStats' state digests, one pass at a time per partition
        self._spec_turn = asyncio.Lock()  # one big job spec read at a time (_job_of)
        self.dense = DenseRpcs(self.layouts, runtime, cfg, self.count, self.slots, handoffs, self.shard.shard_id)
        self.tables = RowRpcs(self.shard, self.layouts, runtime, cfg, self.count, self.slots, self.requests)
        self.engine = StepEngine(self) if cfg.step_engine else None  # StepOnce's steady state (psserver.serving.step_engine)
        self.steps = StepRpc(self.layouts, runtime, cfg, self.count, self.slots, self.dense, self.tables,
                             self.engine, self.shard.count)

    @property
    def host(self) -> ShardHost:
        return self.layouts.current  # the newest layout's: Register, Leave, Heartbeat, ClaimBatch, GetStats

    @property
    def rows(self) -> RowCalls:
        return self.tables.rows  # the row calls' table steps (layout 0's; the step engine's sessions name them)

    def rank_calls(self, rank: int, partition: int = 0) -> int:
        """Calls naming ``rank`` (on ``partition``) in flight now (psserver.serving.call_slots)."""
        return self.slots.rank_calls(rank, partition)

    # ------------------------------------------------------------------ unary RPCs
    @_refusals
    async def Register(self, request, context):
        request = _decoded(request)
        limits.check_id("trainer_id", request.trainer_id)
        job = await self._job_of(request.job, context)
        if request.join and not request.join_round:
            self._check_no_open_plan()
        part = self.layouts.membership.register_host(request.layout_epoch, job.fingerprint).part_for_register(
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
            held.enter_context(self.slots.peer_slot(context))
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
        version, live = self.layouts.membership.heartbeat(request.partition, request.rank, request.trainer_id,
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
                self.layouts.tombstones.was_member(request.rank, request.trainer_id, request.fingerprint):
            reply.layouts.extend(self.layouts.timeline_proto())  # fingerprints: for a member of any layout
        reply.drained = self.layouts.drained  # "tombstone" or "retired" (docs/design/handoff-io.md: when it may be stopped)
        if self.handoffs is not None:
            reply.handoffs.extend(await self.handoffs.records_off_loop())
        return reply

    @_refusals
    async def Reshard(self, request, context):
        """A live re-shard's coordinator call (psserver.resharding.handoff.shard_ops); any op but STATUS changes the job's layout,
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
            return await require_handoffs(self.handoffs).reshard(request)
        finally:
            self.tables.drop_freed_rows()  # after RETIRE: the freed layouts' row calls go too

    @_refusals
    async def Handoff(self, request_iterator, context):
        """A live re-shard's source streaming to this destination (psserver.resharding.handoff.shard_ops), read with the idle and
        total deadlines of every stream: a stream left open holds its bytes and a call of its connection."""
        with self.slots.peer_slot(context):
            self._check_reshard_peer(context, "Handoff")
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self.slots.deadline(context))
            return await require_handoffs(self.handoffs).inbox.handoff(_read_all(reader))

    def _check_no_open_plan(self) -> None:
        """A join's admission waits out a live re-shard (UNAVAILABLE, reason ``handoff``; the joiner asks again):
        admitted between PREPARE and DECIDE, its epoch would be mixed into moves copied without it."""
        handoffs = self.handoffs
        plan = handoffs.plan if handoffs is not None else None
        if plan is not None and not handoffs.decision.settled():
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

    def _digest(self, part: Shard, request):
        """The partition's state digest, for members (or any caller of a shard that authenticates them all),
        hashed on the state worker: a pass over a big table took seconds, and on the loop it held every
        heartbeat and health check that long.  One pass at a time, shared by the callers waiting for it
        (psserver.serving.digest_gate): many callers cost the worker no more than one."""
        if not self.authenticated:
            _check_identity(request)
            part.admission.check_digest_caller(request.rank, request.trainer_id, request.fingerprint)
        return self.digests.digest(part)

    # ------------------------------------------------------------------ streams in (psserver.serving.service_dense)
    @_refusals
    async def Init(self, request_iterator, context):
        return await self.dense.init(request_iterator, context)

    @_refusals
    async def Push(self, request_iterator, context):
        return await self.dense.push(request_iterator, context)

    @_refusals
    @_reply_stream
    async def PushPull(self, request_iterator, context: ReplyStream):
        """Push, then stream the weights of the version the trainer waits for next (see ps.proto)."""
        await self.dense.push_pull(request_iterator, context)

    # ------------------------------------------------------------------ streams out
    @_refusals
    @_reply_stream
    async def Pull(self, request, context: ReplyStream):
        await self.dense.pull(request, context)

    # ------------------------------------------------------------------ tables (psserver.serving.service_rows)
    @_refusals
    @_reply_stream
    async def PullRows(self, request, context: ReplyStream):
        """The rows of unique ids of one table, in request order, once the table reached min_version."""
        await self.tables.pull_rows(request, context)

    @_refusals
    async def PushRows(self, request_iterator, context):
        """Summed gradient rows of unique ids for one table (see ps.proto and psserver.sparse.serving)."""
        return await self.tables.push_rows(request_iterator, context)

    @_refusals
    @_reply_stream
    async def PushPullRows(self, request_iterator, context: ReplyStream):
        """PushRows, then the rows of the header's ``pull_ids`` at the version the push leads to, in one call."""
        await self.tables.push_pull_rows(request_iterator, context)

    # ------------------------------------------------------------------ a step in one call (psserver.serving.service_step)
    @_refusals
    @_reply_stream
    async def Step(self, request_iterator, context: ReplyStream):
        """A step's dense PushPull and table PushPullRows in one call (see ps.proto)."""
        await self.steps.step(request_iterator, context)

    @_refusals
    @_reply_stream  # (for its peer slot, deadline and held bytes: nothing is written to a unary call)
    async def StepOnce(self, request, context: ReplyStream):
        """A Step in one message answered in one message (ps.proto)."""
        return await self.steps.step_once(request, context)


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
