"""The gRPC servicer: decode, call the shard, encode, and map errors to status codes.

Kept thin on purpose: every decision lives in ``psserver.shard`` and
``psserver.modes``.  Every refusal goes through ``_refusals`` -- one place that
counts it, logs it, and aborts with the error's status code and message, so no
refusal ever surfaces as UNKNOWN.
"""

from __future__ import annotations

import functools
import logging
import queue

import grpc
import torch

from psserver.codec import DEFAULT_CHUNK_BYTES, ChunkReader, encode_raw
from psserver.fastwire import parse_chunk, serialize_chunk
from psserver.errors import VERSION_METADATA_KEY, InvalidRequest, PsError, StaleGradient
from psserver.job import JobSpec
from psserver.proto import ps_pb2 as _pb
from psserver.proto import ps_pb2_grpc as _grpc
from psserver.shard import Shard

log = logging.getLogger(__name__)

_OUTCOMES = {"applied": _pb.APPLIED, "accepted": _pb.ACCEPTED, "duplicate": _pb.DUPLICATE, "scaled": _pb.SCALED,
             "skipped": _pb.SKIPPED}


def _refusals(method):
    """Turn PsError into context.abort with its code; count and log every refusal."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except PsError as e:
            code = e.code
            if isinstance(e, StaleGradient):  # counted and logged by the shard as stale_dropped
                context.set_trailing_metadata(((VERSION_METADATA_KEY, str(e.version)),))
            else:
                self.shard.count(f"refused_{code.name}")
                log.warning("shard %d: %s refused with %s: %s", self.shard.shard_id, method.__name__, code.name, e)
            context.abort(code, str(e))

    return wrapper


class _SnapshotStream:
    """A pull's chunks; hands the snapshot back to the shard once, when the stream ends or is dropped.

    A class rather than a generator with try/finally: gRPC may drop a cancelled
    call's iterator before ever starting it, and a generator that never started
    never runs its finally.
    """

    def __init__(self, chunks, release):
        self._chunks, self._release = chunks, release

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._chunks)
        except BaseException:  # StopIteration included: the stream is over
            self.close()
            raise

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    __del__ = close


class ParameterServerService(_grpc.ParameterServerServicer):
    def __init__(self, shard: Shard, max_push_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_pull_wait: float = 600.0, nonfinite: str = "refuse"):
        if nonfinite not in ("refuse", "skip"):
            raise ValueError(f"The non-finite policy ({nonfinite!r}) must be 'refuse' or 'skip'.")
        self.nonfinite = nonfinite
        self._scratch: queue.SimpleQueue = queue.SimpleQueue()  # receive buffers, one per concurrent push at most
        self.shard = shard
        self.max_push_bytes = max_push_bytes
        self.chunk_bytes = chunk_bytes
        self.max_pull_wait = max_pull_wait

    @_refusals
    def Register(self, request, context):
        try:
            job = JobSpec.from_proto(request.job)
        except ValueError as e:
            raise InvalidRequest(f"job spec: {e}") from None
        r = self.shard.register(request.rank, request.trainer_id, request.expected_shard, job)
        return _pb.RegisterReply(**r)

    @_refusals
    def Init(self, request_iterator, context):
        reader = ChunkReader(request_iterator)
        h = reader.header
        values = reader.read(self.shard.slice_length(), self.shard.wire_dtype(), self.max_push_bytes)
        accepted, version = self.shard.init(h.rank, h.trainer_id, h.fingerprint, values, take=True)
        self.shard.count("bytes_in", reader.bytes_read)
        return _pb.InitReply(version=version, accepted=accepted)

    @_refusals
    def Pull(self, request, context):
        wire = request.dtype or self.shard.wire_dtype()
        if wire not in (_pb.FLOAT32, self.shard.wire_dtype()):
            raise InvalidRequest(f"pull dtype is {wire} but this job sends {self.shard.wire_dtype()} (or FLOAT32)")
        return self._pull(request.rank, request.trainer_id, request.fingerprint, request.min_version, wire, context)

    def _pull(self, rank: int, trainer_id: str, fingerprint: str, min_version: int, wire: int, context,
              **reply_fields) -> "_SnapshotStream":
        remaining = context.time_remaining()
        # Give up a little before the caller's deadline so it gets our reason, not a bare DEADLINE_EXCEEDED.
        timeout = self.max_pull_wait if remaining is None else min(max(0.0, remaining - 0.25), self.max_pull_wait)
        version, snapshot, waited = self.shard.pull(rank, trainer_id, fingerprint, min_version, wire, timeout)
        self.shard.count("bytes_out", snapshot.numel() * snapshot.element_size())
        header = _pb.ChunkHeader(dtype=wire, length=snapshot.numel(), version=version, wait_seconds=waited,
                                 **reply_fields)
        return _SnapshotStream(encode_raw(snapshot, header, self.chunk_bytes),
                               lambda: self.shard.release_snapshot(snapshot))

    @_refusals
    def Push(self, request_iterator, context):
        r = self._push(ChunkReader(request_iterator))
        return _pb.PushReply(outcome=_OUTCOMES[r.outcome], version=r.version, staleness=r.staleness)

    @_refusals
    def PushPull(self, request_iterator, context):
        """Push, then stream the weights of the version the trainer waits for next (see ps.proto)."""
        reader = ChunkReader(request_iterator)
        h = reader.header
        try:
            r = self._push(reader)
            outcome, staleness = _OUTCOMES[r.outcome], r.staleness
            # async: the version after its own step; sync modes: its round closed (also for a retry's duplicate)
            wanted = r.version if self.shard.mode() == "async" else h.version + 1
        except StaleGradient as e:  # counted and logged by the shard; the trainer catches up in this call
            outcome, staleness, wanted = _pb.STALE, e.staleness, e.version
        return self._pull(h.rank, h.trainer_id, h.fingerprint, wanted, self.shard.wire_dtype(), context,
                          outcome=outcome, staleness=staleness)

    def _push(self, reader: ChunkReader):
        """Check, read and hand one pushed gradient to the shard; its PushResult."""
        h = reader.header
        self.shard.check_push_header(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples)
        refuse_nonfinite = self.nonfinite == "refuse"
        length = self.shard.slice_length()
        scratch = self._scratch_buffer(length)
        try:
            grad = reader.read(length, self.shard.wire_dtype(), self.max_push_bytes, require_finite=refuse_nonfinite,
                               out=scratch)
            self.shard.count("bytes_in", reader.bytes_read)
            finite = refuse_nonfinite or bool(torch.isfinite(grad).all())
            r = self.shard.push(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples, grad, h.sequence,
                                finite=finite)
        finally:
            self._scratch.put(scratch)  # the shard copied what it keeps (into its round sum or its parameters)
        return r

    def _scratch_buffer(self, length: int) -> torch.Tensor:
        """A reusable receive buffer: fresh 10-100 MB allocations cost more in page faults than the copy itself."""
        try:
            buf = self._scratch.get_nowait()
            if buf.numel() == length:
                return buf
        except queue.Empty:
            pass
        return torch.empty(length, dtype=torch.float32)

    @_refusals
    def Leave(self, request, context):
        remaining = self.shard.leave(request.rank, request.trainer_id, request.fingerprint)
        return _pb.LeaveReply(remaining=remaining)

    @_refusals
    def Heartbeat(self, request, context):
        version, live = self.shard.heartbeat(request.rank, request.trainer_id, request.fingerprint)
        return _pb.HeartbeatReply(version=version, live=live)

    def GetStats(self, request, context):
        s = self.shard.stats()
        job = s.pop("job")
        reply = _pb.StatsReply(**s, state_digest=self.shard.state_digest())
        if job is not None:
            reply.job.CopyFrom(job.to_proto())
        return reply


SERVICE = "psgrpc.v1.ParameterServer"


def add_service(servicer: ParameterServerService, server: grpc.Server) -> None:
    """Register the servicer like the generated ``add_ParameterServerServicer_to_server``, except that
    Chunk streams use psserver.fastwire (same bytes on the wire, fewer copies)."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Register": unary(servicer.Register, _pb.RegisterRequest.FromString, _pb.RegisterReply.SerializeToString),
        "Init": grpc.stream_unary_rpc_method_handler(servicer.Init, parse_chunk, _pb.InitReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, _pb.PullRequest.FromString, serialize_chunk),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, parse_chunk, _pb.PushReply.SerializeToString),
        "PushPull": grpc.stream_stream_rpc_method_handler(servicer.PushPull, parse_chunk, serialize_chunk),
        "Leave": unary(servicer.Leave, _pb.LeaveRequest.FromString, _pb.LeaveReply.SerializeToString),
        "Heartbeat": unary(servicer.Heartbeat, _pb.HeartbeatRequest.FromString, _pb.HeartbeatReply.SerializeToString),
        "GetStats": unary(servicer.GetStats, _pb.StatsRequest.FromString, _pb.StatsReply.SerializeToString),
    }
    missing = set(_pb.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name) - set(handlers)
    if missing:
        raise RuntimeError(f"protos/ defines RPCs this server does not register: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
