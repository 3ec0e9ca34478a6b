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
* Nothing a client declares is trusted before it is bounded (psserver.limits),
  and a caller is identified (job, rank, trainer id) before its payload is read.
* Every stream has an idle and a total deadline enforced here, whatever the
  client asked for; a call whose client went away is cancelled by gRPC and its
  waits end at once.
* Every refusal goes through ``_refusals``: counted in full, logged at a
  bounded rate, aborted with its one documented status code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import torch

from psserver import limits, modes
from psserver.codec import (
    DEFAULT_CHUNK_BYTES, ChunkAssembler, TopKAssembler, check_finite, check_stream_header, encode_raw,
    first_header,
)
from psserver.errors import (
    VERSION_METADATA_KEY, InvalidRequest, PsError, ShuttingDown, StaleGradient, StreamTimeout, TooBusy, WaitTimeout,
)
from psserver.fastwire import parse_chunk, serialize_chunk
from psserver.job import JobSpec
from psserver.logsafe import RateLimitedLog, counted, shorten
from psserver.proto import ps_pb2 as _pb
from psserver.runtime import Runtime
from psserver.shard import PushResult, Shard

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
    max_calls_per_peer: int = 64  # data calls in flight on one connection
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
        for name in ("max_calls_per_peer", "max_calls_per_rank", "receive_buffers"):
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
            if isinstance(e, StaleGradient):  # counted and logged by the shard as stale_dropped
                context.set_trailing_metadata(((VERSION_METADATA_KEY, str(e.version)),))
            elif isinstance(e, WaitTimeout):  # a wait that ended, not bad input: trainers poll while peers start
                self.shard.count("pull_wait_timeouts")
                self.refusal_log.log(logging.INFO, f"{method.__name__}:wait", "shard %d: %s", self.shard.shard_id, e)
            else:
                self.shard.count(f"refused_{code.name}")
                self.refusal_log.warning(f"{method.__name__}:{code.name}", "shard %d: %s refused with %s: %s",
                                         self.shard.shard_id, method.__name__, code.name, e)
            await context.abort(code, str(e))

    return wrapper


class _StreamReader:
    """A request stream read with the server's idle and total deadlines.

    A timer armed for each read cancels the handler's task when it fires -- cheaper
    than ``asyncio.wait_for``, which wraps every read in a task of its own.
    """

    def __init__(self, iterator, idle: float, deadline: float):
        self._it = iterator.__aiter__()
        self._idle, self._deadline = idle, deadline
        self._fired = False

    def _fire(self, task: asyncio.Task) -> None:
        self._fired = True
        task.cancel()

    async def next(self):
        loop = asyncio.get_running_loop()
        left = self._deadline - loop.time()
        if left <= 0:
            raise StreamTimeout("the call outlived the shard's limit on one call's duration (--max-call-seconds)")
        wait = min(self._idle, left)
        timer = loop.call_later(wait, self._fire, asyncio.current_task())
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if not self._fired:
                raise  # the client went away: gRPC cancelled the call
            task = asyncio.current_task()
            if hasattr(task, "uncancel"):  # Python 3.11+: clear the cancellation this timer requested
                task.uncancel()
            raise StreamTimeout(
                f"no chunk arrived for {wait:.1f} s: the shard ends idle streams (--stream-idle-timeout) and "
                "calls past --max-call-seconds") from None
        finally:
            timer.cancel()

    async def first_header(self):
        first = await self.next()
        if first is None:
            raise InvalidRequest("the stream is empty: the first chunk must carry a header")
        return first, first_header(first)


def _check_identity(request) -> None:
    """Bound the strings a caller identifies itself with before they are compared, stored or logged."""
    limits.check_id("trainer_id", request.trainer_id)
    limits.check_id("fingerprint", request.fingerprint)


def _check_header_fields(h: _pb.ChunkHeader) -> None:
    _check_identity(h)
    if h.num_samples > limits.MAX_NUM_SAMPLES:
        raise InvalidRequest(f"num_samples is {h.num_samples}, over the limit of {limits.MAX_NUM_SAMPLES}")
    if h.sequence > limits.MAX_SEQUENCE:
        raise InvalidRequest(f"sequence is {h.sequence}, over the limit of {limits.MAX_SEQUENCE}")


class ParameterServerService:
    def __init__(self, shard: Shard, runtime: Runtime, cfg: ServiceLimits = ServiceLimits()):
        self.shard, self.runtime, self.cfg = shard, runtime, cfg
        self.refusal_log = RateLimitedLog(log)
        self._per_peer: dict[str, int] = {}
        self._per_rank: dict[int, int] = {}

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
        peer = context.peer() or "?"
        return self._slot(self._per_peer, peer, self.cfg.max_calls_per_peer,
                          f"connection {shorten(peer)} (--max-calls-per-peer)")

    def _rank_slot(self, rank: int):
        return self._slot(self._per_rank, rank, self.cfg.max_calls_per_rank, f"rank {rank} (--max-calls-per-rank)")

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
        r = await self.runtime.run_state(self.shard.register, request.rank, request.trainer_id,
                                         request.expected_shard, job)
        return _pb.RegisterReply(**r)

    @_refusals
    async def Leave(self, request, context):
        request = _decoded(request)
        _check_identity(request)
        remaining = await self.runtime.run_state(self.shard.leave, request.rank, request.trainer_id,
                                                 request.fingerprint)
        return _pb.LeaveReply(remaining=remaining)

    @_refusals
    async def Heartbeat(self, request, context):
        """Answered on the event loop: a lease renewal never waits behind tensor work."""
        request = _decoded(request)
        _check_identity(request)
        version, live = self.shard.heartbeat(request.rank, request.trainer_id, request.fingerprint)
        return _pb.HeartbeatReply(version=version, live=live)

    @_refusals
    async def GetStats(self, request, context):
        request = _decoded(request)
        s = self.shard.snapshot()
        digest = await self.runtime.run_state(self.shard.state_digest) if request.with_digest else ""
        reply = _pb.StatsReply(shard=s.shard, initialized=s.initialized, version=s.version, mode=s.mode,
                               start=s.start, end=s.end, live_ranks=s.live_ranks, counters=s.counters,
                               state_digest=digest, lr=s.lr)
        if s.job is not None:
            reply.job.CopyFrom(s.job.to_proto())
        return reply

    # ------------------------------------------------------------------ streams in
    @_refusals
    async def Init(self, request_iterator, context):
        async with self._peer_slot(context):
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
            first, h = await reader.first_header()
            _check_header_fields(h)
            # who is asking, before a byte of the payload is read
            if not self.shard.check_init_header(h.rank, h.trainer_id, h.fingerprint):
                return _pb.InitReply(version=self.shard.version, accepted=False)
            values = await self._read_tensor(reader, first, h)
            accepted, version = await self.runtime.run_state(self._check_and_init, h, values)
            return _pb.InitReply(version=version, accepted=accepted)

    @_refusals
    async def Push(self, request_iterator, context):
        async with self._peer_slot(context):
            _, r = await self._receive_push(request_iterator, context, stale_as_result=False)
            return _pb.PushReply(outcome=_OUTCOMES[r.outcome], version=r.version, staleness=r.staleness)

    @_refusals
    async def PushPull(self, request_iterator, context):
        """Push, then stream the weights of the version the trainer waits for next (see ps.proto)."""
        async with self._peer_slot(context):
            h, r = await self._receive_push(request_iterator, context, stale_as_result=True)
            wanted = modes.reply_version(self.shard.mode_config(), r.outcome, h.version, r.version)
            await self._stream_weights(h.rank, h.trainer_id, h.fingerprint, wanted, self.shard.wire_dtype(),
                                       context, outcome=_OUTCOMES[r.outcome], staleness=r.staleness)

    async def _receive_push(self, request_iterator, context, stale_as_result: bool):
        """Bound, identify, read and hand one pushed gradient to the shard: (header, PushResult)."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self._deadline(context))
        first, h = await reader.first_header()
        _check_header_fields(h)
        self.shard.check_push_header(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples)
        length = self.shard.slice_length()
        check_stream_header(h, length, self.shard.wire_dtype(), self.cfg.max_push_bytes)  # before any allocation
        async with self._rank_slot(h.rank), self.runtime.buffers.take(length) as held:
            grad = await self._read_tensor(reader, first, h, out=held.buffer, sparse=True)
            try:
                result, spare = await held.hand_over(self.runtime.run_state(self._check_and_push, h, grad))
            except StaleGradient as e:
                if not stale_as_result:
                    raise
                result = PushResult("stale", e.version, e.staleness)  # counted by the shard; the reply catches up
            else:
                held.buffer = spare
        return h, result

    async def _read_tensor(self, reader: _StreamReader, first, h: _pb.ChunkHeader,
                           out: torch.Tensor | None = None, sparse: bool = False) -> torch.Tensor:
        """The stream's chunks, checked and copied (into ``out`` if given) as they arrive; finite-checked later.

        ``sparse`` (pushes): a header with topk > 0 is read as top-k pairs, bounded, and scattered into ``out``
        as a dense slice; elsewhere (Init) such a header is refused."""
        assembler = TopKAssembler if sparse and h.topk else ChunkAssembler
        asm = assembler(h, self.shard.slice_length(), self.shard.wire_dtype(), self.cfg.max_push_bytes,
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

    def _check_and_init(self, h: _pb.ChunkHeader, values: torch.Tensor):
        check_finite(values)
        return self.shard.init(h.rank, h.trainer_id, h.fingerprint, values, True)

    def _check_and_push(self, h: _pb.ChunkHeader, grad: torch.Tensor):
        """On the state worker, in one hop: refuse NaN/Inf (--nonfinite refuse) or note them (skip), then push.

        One thread for all of a shard's tensor work: a second pool for the finite check cost a second hop per
        push and a second set of OpenMP threads spinning on the trainers' cores (ps-bench: -5 to -15% CNN).
        """
        if self.cfg.nonfinite == "refuse":
            check_finite(grad)
            finite = True
        else:
            finite = bool(torch.isfinite(grad).all())
        return self.shard.push(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples, grad, h.sequence,
                               finite)

    # ------------------------------------------------------------------ streams out
    @_refusals
    async def Pull(self, request, context):
        request = _decoded(request)
        async with self._peer_slot(context):
            _check_identity(request)
            wire = request.dtype or self.shard.wire_dtype()
            if wire not in (_pb.FLOAT32, self.shard.wire_dtype()):
                raise InvalidRequest(
                    f"pull dtype is {wire} but this job sends {self.shard.wire_dtype()} (or FLOAT32)")
            await self._stream_weights(request.rank, request.trainer_id, request.fingerprint, request.min_version,
                                       wire, context)

    async def _stream_weights(self, rank: int, trainer_id: str, fingerprint: str, min_version: int, wire: int,
                              context, **reply_fields) -> None:
        """Wait (an awaited future, no thread) for ``min_version``, then stream the weights in chunks."""
        self.shard.check_member(rank, trainer_id, fingerprint)
        loop = asyncio.get_running_loop()
        remaining = self._deadline(context) - loop.time()
        # Give up a little before the caller's deadline so it gets our reason, not a bare DEADLINE_EXCEEDED.
        timeout = min(max(0.0, remaining - 0.25), self.cfg.max_pull_wait)
        t0 = loop.time()
        if not await self.runtime.waiters.wait(min_version, timeout):
            raise WaitTimeout(self.shard.pull_wait_message(min_version, timeout))
        waited = loop.time() - t0
        if self.runtime.stopping:
            raise ShuttingDown(f"shard {self.shard.shard_id} is shutting down")
        version, snapshot = await self.runtime.acquire_snapshot(rank, trainer_id, fingerprint, wire)
        try:
            self.shard.count("bytes_out", snapshot.numel() * snapshot.element_size())
            header = _pb.ChunkHeader(dtype=wire, length=snapshot.numel(), version=version, wait_seconds=waited,
                                     **reply_fields)
            for chunk in encode_raw(snapshot, header, self.cfg.chunk_bytes):
                await context.write(chunk)
        finally:
            self.runtime.release_snapshot(snapshot)


SERVICE = "psgrpc.v1.ParameterServer"


def add_service(servicer: ParameterServerService, server) -> None:
    """Register the servicer like the generated ``add_ParameterServerServicer_to_server``, except that
    Chunk streams use psserver.fastwire (same bytes on the wire, fewer copies) and undecodable unary
    requests reach the handler (to be refused as INVALID_ARGUMENT, not INTERNAL)."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Register": unary(servicer.Register, _safe(_pb.RegisterRequest.FromString), _pb.RegisterReply.SerializeToString),
        "Init": grpc.stream_unary_rpc_method_handler(servicer.Init, parse_chunk, _pb.InitReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, _safe(_pb.PullRequest.FromString), serialize_chunk),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, parse_chunk, _pb.PushReply.SerializeToString),
        "PushPull": grpc.stream_stream_rpc_method_handler(servicer.PushPull, parse_chunk, serialize_chunk),
        "Leave": unary(servicer.Leave, _safe(_pb.LeaveRequest.FromString), _pb.LeaveReply.SerializeToString),
        "Heartbeat": unary(servicer.Heartbeat, _safe(_pb.HeartbeatRequest.FromString),
                           _pb.HeartbeatReply.SerializeToString),
        "GetStats": unary(servicer.GetStats, _safe(_pb.StatsRequest.FromString), _pb.StatsReply.SerializeToString),
    }
    missing = set(_pb.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name) - set(handlers)
    if missing:
        raise RuntimeError(f"protos/ defines RPCs this server does not register: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
