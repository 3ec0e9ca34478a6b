"""The trainer's side of the wire: one channel per shard, fan-out, deadlines, retries.

``ShardClient`` speaks to one shard; ``ShardedClient`` holds one per shard and
runs their calls in parallel.  Every call has a deadline.  UNAVAILABLE (and,
for pushes, DEADLINE_EXCEEDED) is retried with exponential backoff and full
jitter for up to ``RetryPolicy.budget_seconds`` -- long enough to ride out a
shard restart.  Retrying is safe: Register and Init are idempotent, Pull is a
read, and a retried Push carries the same sequence number, so the shard
acknowledges it as a duplicate instead of applying it twice.  Every retry and
every stale push is counted in ``counters`` and logged.

Why it is over 500 lines: the dense chunk streams (fastwire, push-pull, one-chunk unary pushes) and the retry
discipline are one piece; the session (trainer.session), the step (trainer.exchange) and what the next push
sends -- its number and encoding (trainer.dense_push over trainer.push_numbers) -- are rooms of their own.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import grpc
import grpc.experimental
import torch

from psserver.protocol.codec import DEFAULT_CHUNK_BYTES, ChunkReader, encode_raw, wire_tensor
from psserver.protocol.fastwire import parse_chunk, serialize_chunk
from psserver.protocol.job import WIRE_DTYPES, JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.proto import ps_pb2_grpc as _grpc
from psserver.protocol.rules import (
    STALE,
    refused_job_ended,
    refused_layout_ahead,
    refused_layout_moved,
    refused_no_job,
    stale_version,
)
from psserver.protocol.security import ClientSecurity, parse_addresses  # noqa: F401 (re-exported for trainers)
from psserver.protocol.stubs import method
from trainer.compress import TopK, parse_compress
from trainer.dense_push import OutgoingPush

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# A push is also retried after DEADLINE_EXCEEDED: its reply may have been lost, and the sequence number
# makes the retry a DUPLICATE rather than a second application.
PUSH_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


CONNECT_ATTEMPT_SECONDS = 3.0  # one Register attempt; a shard that never answers is reported after this
CONNECT_RETRY_PAUSE = 0.5  # between Register attempts to a shard that refused
WAIT_LOG_SECONDS = 5.0  # while connecting or waiting for peers, say what is awaited this often
# Every address on loopback and refused this long in a row: a wrong port, not a shard starting late on another
# host -- give up with the usual error instead of waiting out --connect-timeout.
LOOPBACK_REFUSED_SECONDS = 5.0
LOOPBACK_HOSTS = ("localhost", "127.", "[::1]", "::1")


def on_loopback(addresses: Sequence[str]) -> bool:
    """Whether every address is on this host's loopback."""
    return all(a.startswith(LOOPBACK_HOSTS) for a in addresses)


class ShardUnreachable(ConnectionError):
    """A shard did not answer within the connect timeout; the message names it and its address."""


class RefusalClock:
    """How long a shard has refused connections in a row; ``exhausted`` once that passes ``limit`` (None: never)."""

    def __init__(self, limit: float | None):
        self.limit, self.since = limit, None

    def exhausted(self, cause: str, now: float) -> bool:
        if self.limit is None or not cause.endswith("connection refused"):
            self.since = None  # it answered, or timed out: a shard that is there but slow is waited for
            return False
        self.since = now if self.since is None else self.since
        return now - self.since >= self.limit


class ConnectAbandoned(ConnectionError):
    """Registering was given up because the caller was interrupted (ShardClient.register's ``abandon``)."""


# A shard answering these restarted: it no longer knows the trainer, came back empty, or is behind it.
# The trainer registers again (dense slice: trainer.api; tables: trainer.sparse_client).
RESTART_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION)


def restarted(error: grpc.RpcError) -> bool:
    """Whether ``error`` says the shard restarted (register again).  The reason trailer is read first: a
    ``layout-moved`` refusal (FAILED_PRECONDITION) means the job switched layouts -- the call changed nothing and
    goes again in the new layout (trainer.relayout) -- and ``layout-ahead`` (OUT_OF_RANGE) is retried within the
    retry budget (ShardClient._call); neither is a restart (docs/live-reshard.md)."""
    if error.code() not in RESTART_CODES:
        return False
    return refused_layout_moved(error) is None and not refused_layout_ahead(error)


class ShardCallsFailed(grpc.RpcError, RuntimeError):
    """Calls that failed for good on some shards: an ``RpcError`` whose ``code()`` is the first failing
    shard's (callers that handle a refusal by its code keep working), its message naming every failure
    with its shard's address.  ``failed``: shard -> the error."""

    def __init__(self, message: str, failed: dict):
        self.failed, self.message = failed, message
        first = failed[min(failed)]
        self._code = first.code() if isinstance(first, grpc.RpcError) else grpc.StatusCode.UNKNOWN
        super().__init__(message)

    @staticmethod
    def causes(failed: dict, addresses: Sequence[str], names: Sequence[str] | None = None) -> str:
        """Each failure named "shard I at ADDRESS: CODE: details" (``names[i]`` in place of "shard I")."""
        return "; ".join(
            f"{names[i] if names else f'shard {i}'} at {addresses[i]}: "
            + (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}")
            for i, e in sorted(failed.items()))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message


class NoJobToJoin(ConnectionError):
    """A joiner waited ``--connect-timeout`` and the shard still ran no job: rank 0 never registered."""


class JobEnded(NoJobToJoin):
    """A joiner found the job ended (every trainer left): nothing to join, and nothing will be (ps-trainer
    exits 0 with this message: a Deployment's replicas that outlive rank 0's Job complete, not crash-loop)."""


CONNECT_RETRY, JOIN_WAIT = "connect_retries", "join_waits"  # what a Register attempt is retried for (counters)
JOB_OVER = "job_ended"  # register_retry's answer for a join to a job that ended: not retried, JobEnded raised


def claim_fields(ask: tuple[int, int] | None) -> dict:
    return {} if ask is None else dict(claim=ask[0], batches_per_epoch=ask[1])


def register_retry(error: grpc.RpcError, join: bool, join_round: int) -> str:
    """Whether a failed Register attempt is tried again, and counted as what: ``CONNECT_RETRY`` (the shard is
    not answering yet), ``JOIN_WAIT`` (a join's admission reached a shard that runs no job yet: the joiner
    started before rank 0 registered the job, as a scaled service's replicas may), ``JOB_OVER`` (a join's
    admission found the job ended: raise JobEnded, not retried), or '' (raise it).
    A commit (``join_round`` > 0) that finds no job is not waited out: that shard restarted empty since
    admitting it, and the joiner leaves and joins again (docs/elastic.md)."""
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CONNECT_RETRY
    if join and join_round == 0 and refused_no_job(error):
        return JOIN_WAIT
    if join and join_round == 0 and refused_job_ended(error):
        return JOB_OVER
    return ""


def _connect_cause(e: grpc.RpcError) -> str:
    """A short reason for a failed connection attempt ("connection refused", "no reply within 3 s")."""
    details = e.details() or ""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no reply within {CONNECT_ATTEMPT_SECONDS:g} s"
    for known in ("Connection refused", "No route to host", "Name or service not known", "DNS resolution failed",
                  "Connection reset by peer", "Socket closed"):
        if known.lower() in details.lower():
            return f"UNAVAILABLE: {known.lower()}"
    return f"UNAVAILABLE: {details[:200]}"


def _give_up_if_due(where: str, retry: str, cause: str, now: float, give_up: float, connect_timeout: float,
                    refusals: RefusalClock) -> None:
    """Raise once ``--connect-timeout`` has passed (or a loopback shard refused connections too long);
    ``where``: "shard I at ADDRESS"."""
    if now >= give_up and retry == JOIN_WAIT:
        raise NoJobToJoin(f"{where} still ran no job to join after "
                          f"{connect_timeout:g} s (--connect-timeout): start the job's rank 0 (ps-trainer "
                          f"--rank 0, no --join), or give the joiner a longer --connect-timeout")
    if now >= give_up:
        raise ShardUnreachable(f"{where} did not answer within "
                               f"{connect_timeout:g} s (--connect-timeout): {cause}") from None
    if refusals.exhausted(cause, now):  # a join's wait is an answer: it resets the clock
        raise ShardUnreachable(
            f"{where} did not answer within {refusals.limit:g} s (every "
            f"address is on loopback and it refuses connections: check the port, or start the shard "
            f"first; --connect-timeout waits only for remote shards or ones that answer): {cause}"
        ) from None


@dataclass(frozen=True)
class PushOutcome:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled" | "stale"
    version: int  # the shard's version after the push
    staleness: int


@dataclass(frozen=True)
class RetryPolicy:
    budget_seconds: float = 60.0  # keep retrying one call this long (a restarting shard needs seconds)
    initial_backoff: float = 0.05
    max_backoff: float = 2.0


class ShardClient:
    """Calls to one partition of one shard: ``index`` is the shard's position in the --ps list, ``partition``
    the piece of its slice (JobSpec.partitions), ``slot`` the piece's position among all of the job's
    (``index * partitions + partition``; the shard's index when unpartitioned)."""

    def __init__(self, address: str, index: int, rank: int, trainer_id: str, fingerprint: str,
                 counters: Counter, chunk_bytes: int = DEFAULT_CHUNK_BYTES, call_timeout: float = 60.0,
                 retry: RetryPolicy = RetryPolicy(), security: ClientSecurity = ClientSecurity(),
                 counters_lock: threading.Lock | None = None, compressor: TopK | None = None,
                 partition: int = 0, slot: int | None = None, channel: grpc.Channel | None = None):
        """``channel``: one to share (a layout switch reuses the old client's for the same address and partition)."""
        self.address, self.index, self.rank, self.trainer_id = address, index, rank, trainer_id
        self.partition, self.slot = partition, index if slot is None else slot
        self.name = f"shard {index}" + (f" partition {partition}" if partition else "")  # in messages
        self.compressor = compressor  # top-k with error feedback for this shard's slice (trainer.compress)
        self.outgoing = OutgoingPush(chunk_bytes, compressor)  # the next push's number and kept pairs
        self.fingerprint, self.counters, self.chunk_bytes = fingerprint, counters, chunk_bytes
        self.call_timeout, self.retry = call_timeout, retry
        self.last_answer: tuple[int, PushOutcome] | None = None  # (sequence, outcome) of the last answered push
        self.epoch_seen = 0  # the membership epoch of the newest weights received (docs/elastic.md)
        # the layout epoch this client's calls name, and the newest one any reply or layout-moved refusal named
        # (docs/live-reshard.md; trainer.relayout follows it)
        self.layout_epoch = self.layout_seen = 0
        self.leaving = False  # pushes from now on say this trainer's last gradient (ChunkHeader.leaving)
        # shard 0 partition 0 of an async elastic job (trainer.data_claims): (claim number, batches per epoch) the
        # next push also claims, and (claim number, batch, re-issued) a PushPull reply granted
        self.claim_ask: tuple[int, int] | None = None
        self.claim_answer: tuple[int, int, bool] | None = None
        self._lock = counters_lock or threading.Lock()  # the one lock of ``counters``, which shards share
        self.channel = channel or security.channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.keepalive_time_ms", 30_000),
                # A connection of its own: gRPC otherwise shares one TCP connection among every channel of the
                # process to the same address, and a shard limits data calls per connection.
                ("grpc.use_local_subchannel_pool", 1),
                # Reconnect quickly after a dropped connection or a restarted shard (gRPC's default waits 1 s+).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
                # Pulls run on the calling thread: no channel-spin thread started per call.
                (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
            ],
        )
        self.stub = _grpc.ParameterServerStub(self.channel)
        # Chunk streams bypass the generated classes (psserver.protocol.fastwire: same bytes, fewer copies).
        self._init = self.channel.stream_unary(method("Init"), serialize_chunk, _pb.InitReply.FromString)
        self._push = self.channel.stream_unary(method("Push"), serialize_chunk, _pb.PushReply.FromString)
        # A one-chunk push sent as a unary call on the same method: the bytes on the wire are those of a
        # client stream with one message, but gRPC Python starts no request-consuming thread for it.
        self._push_one = self.channel.unary_unary(method("Push"), serialize_chunk, _pb.PushReply.FromString)
        self._pull = self.channel.unary_stream(method("Pull"), _pb.PullRequest.SerializeToString, parse_chunk)
        self._push_pull = self.channel.stream_stream(method("PushPull"), serialize_chunk, parse_chunk)
        self._push_pull_one = self.channel.unary_stream(method("PushPull"), serialize_chunk, parse_chunk)

    def saw_layout(self, number: int) -> int:
        """A reply (or a layout-moved refusal) named layout ``number``: the newest seen is kept."""
        self.layout_seen = max(self.layout_seen, number)
        return number

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _call(self, what: str, fn: Callable[[], T], retry_on: tuple = RETRYABLE) -> T:
        """Run ``fn``, retrying ``retry_on`` codes with exponential backoff and full jitter within the budget."""
        delay = self.retry.initial_backoff
        give_up = time.monotonic() + self.retry.budget_seconds
        attempt = 0
        while True:
            attempt += 1
            self._count("round_trips")  # every data call's attempt (heartbeats aside): what a step costs in calls
            try:
                return fn()
            except grpc.RpcError as e:
                self.saw_layout(refused_layout_moved(e) or 0)  # a refused push teaches the newest layout too
                ahead = refused_layout_ahead(e)  # a shard restarted from an older layout record: it catches up
                if (e.code() not in retry_on and not ahead) or time.monotonic() >= give_up:
                    raise
                self._count("retries")
                if ahead:
                    self._count("layout_ahead_retries")
                pause = random.uniform(0, delay)
                log.warning("%s to %s (%s) failed with %s (%s); retry %d in %.2f s", what, self.name,
                            self.address, e.code().name, e.details(), attempt, pause)
                time.sleep(pause)  # backoff between attempts, not synchronisation
                delay = min(delay * 2, self.retry.max_backoff)

    def register(self, job: JobSpec, connect_timeout: float, abandon: threading.Event | None = None,
                 refused_limit: float | None = None, join: bool = False, join_round: int = 0,
                 join_confirm: bool = False) -> _pb.RegisterReply:
        """Register with the shard, waiting up to ``connect_timeout`` for it to answer.

        Each attempt fails fast (no wait_for_ready) and has a short deadline, so an
        address that refuses connections or never answers is logged by shard and
        address within seconds, not after the whole timeout; a shard still starting
        is waited for.  Giving up raises ShardUnreachable naming the address.
        ``abandon``, once set, ends the retries (ConnectAbandoned): the caller was
        interrupted and must know no attempt is left that could register it later.
        ``refused_limit``: give up once the connection has been refused this many seconds in a row (the caller
        passes it when every address is on loopback: a wrong port, not a shard that is late).
        ``join``/``join_round``: a join's admission (0) or commit (trainer.session.Session.join_running), and
        with ``join_confirm`` its confirm.  An
        admission that finds no job yet waits for it within the same timeout (``register_retry``), so joiners
        may start before the job's rank 0; still none then raises NoJobToJoin.
        """
        req = _pb.RegisterRequest(rank=self.rank, trainer_id=self.trainer_id, expected_shard=self.index,
                                  job=job.to_proto(), partition=self.partition, join=join, join_round=join_round,
                                  join_confirm=join_confirm, layout_epoch=self.layout_epoch, follows_layouts=True)
        give_up = time.monotonic() + connect_timeout
        next_log = 0.0
        abandon = abandon or threading.Event()
        refusals = RefusalClock(refused_limit if refused_limit is not None and refused_limit < connect_timeout
                                else None)
        while True:
            if abandon.is_set():
                raise ConnectAbandoned(f"{self.name} at {self.address}: registering was abandoned")
            left = give_up - time.monotonic()
            try:
                reply = self.stub.Register(req, timeout=max(0.01, min(left, CONNECT_ATTEMPT_SECONDS)))
                self.saw_layout(getattr(reply, "layout_epoch", 0))  # (a stand-in stub's reply may carry none)
                return reply
            except grpc.RpcError as e:
                retry = register_retry(e, join, join_round)
                if retry == JOB_OVER:
                    self._count(JOB_OVER)
                    raise JobEnded(f"shard {self.index} at {self.address}: {e.details()}") from None
                if not retry:
                    raise
                cause = _connect_cause(e) if retry == CONNECT_RETRY else e.details()
                now = time.monotonic()
                _give_up_if_due(f"shard {self.index} at {self.address}", retry, cause, now, give_up, connect_timeout,
                                refusals)
                self._count(retry)
                if now >= next_log:
                    if retry == JOIN_WAIT:
                        log.warning("shard %d at %s runs no job yet: waiting for the job's rank 0 to register it; "
                                    "still trying for %.0f s", self.index, self.address, give_up - now)
                    else:
                        log.warning("shard %d at %s is not answering yet (%s); still trying for %.0f s",
                                    self.index, self.address, cause, give_up - now)
                    next_log = now + WAIT_LOG_SECONDS
                if abandon.wait(min(CONNECT_RETRY_PAUSE, max(0.0, give_up - now))):  # the pause between attempts
                    raise ConnectAbandoned(f"{self.name} at {self.address}: registering was abandoned")

    def _header(self, wire: int, length: int, version: int = 0, num_samples: int = 0,
                sequence: int = 0) -> _pb.ChunkHeader:
        return _pb.ChunkHeader(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint,
                               dtype=wire, length=length, version=version, num_samples=num_samples,
                               sequence=sequence, partition=self.partition, leaving=self.leaving,
                               layout_epoch=self.layout_epoch,
                               **claim_fields(self.claim_ask))

    def init(self, values: torch.Tensor, wire: int) -> _pb.InitReply:
        payload = wire_tensor(values, wire)
        header = self._header(wire, values.numel())
        reply = self._call("Init", lambda: self._init(encode_raw(payload, header, self.chunk_bytes),
                                                      timeout=self.call_timeout))
        self._count("bytes_out", payload.numel() * payload.element_size())
        return reply

    def pull(self, min_version: int, wire: int, length: int, timeout: float,
             out: torch.Tensor | None = None) -> tuple[int, torch.Tensor, float]:
        """(version, fp32 parameters, seconds the shard waited) at a version >= min_version.

        Waits up to ``timeout`` for the round; the shard reports how much of the
        call was waiting, so the trainer can split wait from transfer.  With
        ``out`` (the model's flat CPU parameters) the weights land there directly.
        """
        req = _pb.PullRequest(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint,
                              min_version=min_version, dtype=wire, partition=self.partition,
                              layout_epoch=self.layout_epoch)

        def once():
            reader = ChunkReader(self._pull(req, timeout=timeout))
            values = reader.read(length, wire, max_bytes=1 << 40, require_finite=False, out=out)
            self._count("bytes_in", reader.bytes_read)
            self.epoch_seen = reader.header.membership_epoch
            self.saw_layout(reader.header.layout_epoch)
            return reader.header.version, values, reader.header.wait_seconds

        return self._call("Pull", once)

    def _gradient_chunks(self, grad: torch.Tensor, base: int, num_samples: int,
                         wire: int) -> tuple[int, int, list]:
        """(bytes, dense-equivalent bytes, chunks) of a push under the next number (trainer.dense_push)."""
        return self.outgoing.chunks(grad, self._header(wire, grad.numel(), base, num_samples), wire)

    @property
    def unanswered(self) -> bool:
        """Whether the last push has had no answer (the next push reuses its number)."""
        return self.outgoing.numbers.unanswered

    def _acknowledged(self, outcome: str, version: int, staleness: int, base: int, nbytes: int,
                      dense_bytes: int) -> PushOutcome:
        """Count and log what became of a push (the gradient crossed the wire whatever the outcome)."""
        self.outgoing.answered()
        result = PushOutcome(outcome, version, staleness)
        self.last_answer = (self.outgoing.numbers.sequence, result)
        self._count("bytes_out", nbytes)
        self._count("push_bytes_sent", nbytes)
        self._count("push_bytes_dense", dense_bytes)  # what the same pushes would have sent uncompressed
        if outcome == STALE:
            self._count("stale_pushes")
            log.info("%s dropped a stale gradient (base %d, now %d): catching up", self.name, base, version)
        elif outcome in ("duplicate", "skipped"):
            self._count(f"{outcome}_pushes")
        return result

    def push(self, grad: torch.Tensor, base: int, num_samples: int, wire: int) -> PushOutcome:
        nbytes, dense_bytes, chunks = self._gradient_chunks(grad, base, num_samples, wire)
        send = (lambda: self._push_one(chunks[0], timeout=self.call_timeout)) if len(chunks) == 1 else (
            lambda: self._push(iter(chunks), timeout=self.call_timeout))
        try:
            reply = self._call("Push", send, retry_on=PUSH_RETRYABLE)
        except grpc.RpcError as e:
            version = stale_version(e, base)
            if version is None:
                raise
            return self._acknowledged(STALE, version, version - base, base, nbytes, dense_bytes)
        self.saw_layout(reply.layout_epoch)
        return self._acknowledged(_pb.PushOutcome.Name(reply.outcome).lower(), reply.version, reply.staleness, base,
                                  nbytes, dense_bytes)

    def push_pull(self, grad: torch.Tensor, base: int, num_samples: int, wire: int, timeout: float,
                  out: torch.Tensor | None = None) -> tuple[PushOutcome, torch.Tensor, float, float]:
        """Push, and receive the weights of the version to go on from, in one call.

        Returns (outcome, fp32 weights, seconds until the reply began less the shard's
        wait -- push and apply --, seconds the shard waited for the round).  With
        ``out`` the weights land there directly.  Retried like a push: the sequence
        number makes a retry after a lost reply a DUPLICATE, which still returns weights.
        """
        nbytes, dense_bytes, chunks = self._gradient_chunks(grad, base, num_samples, wire)

        def once():
            t0 = time.perf_counter()
            replies = (self._push_pull_one(chunks[0], timeout=timeout) if len(chunks) == 1 else
                       self._push_pull(iter(chunks), timeout=timeout))
            reader = ChunkReader(replies)  # returns once the first reply chunk is here
            t_first = time.perf_counter()
            values = reader.read(grad.numel(), wire, max_bytes=1 << 40, require_finite=False, out=out)
            self._count("bytes_in", reader.bytes_read)
            return reader.header, values, t_first - t0

        h, values, until_reply = self._call("PushPull", once, retry_on=PUSH_RETRYABLE)
        self.epoch_seen = h.membership_epoch
        self.saw_layout(h.layout_epoch)
        self.take_grant(h)
        outcome = self._acknowledged(_pb.PushOutcome.Name(h.outcome).lower(), h.version, h.staleness, base, nbytes,
                                     dense_bytes)
        return outcome, values, max(0.0, until_reply - h.wait_seconds), h.wait_seconds

    def take_grant(self, h) -> None:
        """A dense reply's grant of the data-cursor claim its push carried (trainer.data_claims): kept for
        ``BatchClaims.next``, which then needs no ClaimBatch call (PushPull's reply, or a Step's dense part)."""
        if h.batch_granted and self.claim_ask is not None:
            self.claim_answer = (self.claim_ask[0], h.batch, h.batch_reissued)

    def take_sequence(self) -> int:
        """A number of its own for a windowed push (trainer.windowed): never reused, whatever became of it."""
        with self._lock:
            return self.outgoing.take()  # a plain push's unanswered number is not taken over

    def push_pull_numbered(self, grad: torch.Tensor, base: int, num_samples: int, wire: int, sequence: int,
                           timeout: float, out: torch.Tensor) -> PushOutcome:
        """A windowed push under ``sequence`` (already taken), whose reply's weights land in ``out``.  Retried
        like any push; sent again later by the window under the same number, a shard that applied it answers
        DUPLICATE.  Touches none of the plain push's state, so several may be in flight at once."""
        payload = wire_tensor(grad, wire)
        chunks = list(encode_raw(payload, self._header(wire, grad.numel(), base, num_samples, sequence),
                                 self.chunk_bytes))

        def once():
            replies = (self._push_pull_one(chunks[0], timeout=timeout) if len(chunks) == 1 else
                       self._push_pull(iter(chunks), timeout=timeout))
            reader = ChunkReader(replies)
            reader.read(grad.numel(), wire, max_bytes=1 << 40, require_finite=False, out=out)
            self._count("bytes_in", reader.bytes_read)
            return reader.header

        h = self._call("PushPull", once, retry_on=PUSH_RETRYABLE)
        self.saw_layout(h.layout_epoch)
        nbytes = payload.numel() * payload.element_size()
        for name in ("bytes_out", "push_bytes_sent", "push_bytes_dense"):
            self._count(name, nbytes)
        outcome = _pb.PushOutcome.Name(h.outcome).lower()
        if outcome in ("stale", "duplicate", "skipped"):
            self._count("stale_pushes" if outcome == "stale" else f"{outcome}_pushes")
        return PushOutcome(outcome, h.version, h.staleness)

    def next_sequence(self) -> int:
        """The number the next push will carry (the unanswered one again, if there is one)."""
        return self.outgoing.numbers.upcoming()

    def resend_after_restart(self) -> bool:
        """The shard restarted and forgot the last push: True if the next push sends it again under a new
        number, False if it was abandoned (trainer.dense_push.OutgoingPush.after_restart)."""
        return self.outgoing.after_restart()

    def abandon_push(self) -> None:
        """Give up on the unanswered push (the shard restarted and forgot it): the next push gets a new number."""
        self.outgoing.abandon()

    def heartbeat(self, timeout: float) -> _pb.HeartbeatReply:
        req = _pb.HeartbeatRequest(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint,
                                   partition=self.partition)
        reply = self.stub.Heartbeat(req, timeout=timeout)
        self.saw_layout(reply.layout_epoch)
        return reply

    def claim_batch(self, claim: int, batches_per_epoch: int, release: bool, timeout: float) -> _pb.ClaimReply:
        """Shard 0 partition 0's data cursor (trainer.data_claims); a lost reply is retried under the same
        claim number, which the cursor answers with the same batch."""
        req = _pb.ClaimRequest(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint, claim=claim,
                               batches_per_epoch=batches_per_epoch, release=release)
        return self._call("ClaimBatch", lambda: self.stub.ClaimBatch(req, timeout=timeout), retry_on=PUSH_RETRYABLE)

    def leave(self, quick: bool = False) -> None:
        """Leave the job; ``quick``: one try with a short deadline (closing after another failure)."""
        req = _pb.LeaveRequest(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint,
                               partition=self.partition)
        if quick:
            self.stub.Leave(req, timeout=5.0)
            return
        self._call("Leave", lambda: self.stub.Leave(req, timeout=self.call_timeout))

    def stats(self, members_from_round: int = 0) -> _pb.StatsReply:
        """GetStats asked as this trainer (a member: the reply carries the job's spec too); the membership
        epochs' member lists from ``members_from_round`` on (every epoch's round and size regardless)."""
        req = _pb.StatsRequest(partition=self.partition, rank=self.rank, trainer_id=self.trainer_id,
                               fingerprint=self.fingerprint, members_from_round=members_from_round)
        return self._call("GetStats", lambda: self.stub.GetStats(req, timeout=self.call_timeout))

    def close(self) -> None:
        self.channel.close()


class ShardedClient:
    """One ShardClient per partition of every shard, with calls fanned out in parallel.

    ``parts``: every partition of every shard, in slot order (the flat vector's order) -- the dense
    exchange.  ``shards``: partition 0 of each shard, the same objects -- the sparse tables and tools.
    Unpartitioned, the two lists are the same.  Each partition has a channel (TCP connection) of its own:
    its calls are flow-controlled apart from the others', and a shard's per-connection call limit is not
    shared among them.
    """

    def __init__(self, addresses: Sequence[str], job: JobSpec, rank: int, trainer_id: str,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, call_timeout: float = 60.0,
                 security: ClientSecurity = ClientSecurity(), retry: RetryPolicy = RetryPolicy(),
                 compress: str | None = None):
        if len(addresses) != job.num_shards:
            raise ValueError(f"{len(addresses)} shard addresses given but the job has {job.num_shards} shards")
        topk = parse_compress(compress)
        self.job, self.rank, self.trainer_id = job, rank, trainer_id
        self.addresses, self.security, self.compress = list(addresses), security, compress  # (trainer.relayout)
        self.wire = WIRE_DTYPES[job.wire_dtype]
        self.counters: Counter = Counter()
        self._count_lock = threading.Lock()
        k = job.partitions
        self.parts = [
            ShardClient(addresses[j // k], j // k, rank, trainer_id, job.fingerprint, self.counters, chunk_bytes,
                        call_timeout, retry=retry, security=security, counters_lock=self._count_lock,
                        compressor=TopK(topk.ratio, topk.warmup) if topk is not None else None,
                        partition=j % k, slot=j)
            for j in range(len(addresses) * k)
        ]
        self.shards = self.parts[::k]
        # A worker for every partition's call and every shard's table call: a step's table calls and dense
        # exchange run side by side (trainer.table_push), and neither may wait behind the other's calls.
        self._pool = ThreadPoolExecutor(max_workers=len(self.parts) + len(self.shards), thread_name_prefix="ps-io")

    def replace_parts(self, job: JobSpec, addresses: Sequence[str], parts: list[ShardClient]) -> None:
        """A layout switch (trainer.relayout), between steps: the new job's slots, in place (the session, the slots
        and the exchange hold these lists), and I/O threads enough for them."""
        self.job, self.addresses[:], self.parts[:] = job, addresses, parts
        self.shards[:] = parts[::job.partitions]
        old, self._pool = self._pool, ThreadPoolExecutor(max_workers=len(self.parts) + len(self.shards),
                                                         thread_name_prefix="ps-io")
        old.shutdown(wait=True)

    def map(self, fn: Callable[[ShardClient], T], parts: bool = False) -> list[T]:
        """``fn`` on every shard (every partition: ``parts``) in parallel; results in order; the first error
        is raised."""
        chosen = self.parts if parts else self.shards
        if len(chosen) == 1:
            return [fn(chosen[0])]
        rest = [self._pool.submit(fn, s) for s in chosen[1:]]
        try:
            first = fn(chosen[0])  # on this thread: one hand-off between threads fewer per step
        except BaseException:
            futures_wait(rest)  # no call left running behind the caller; shard 0's error is the one raised
            raise
        return [first, *(f.result() for f in rest)]

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter from any thread (``+=`` on a Counter is not atomic)."""
        with self._count_lock:
            self.counters[name] += n

    def map_settled(self, fn: Callable[[ShardClient], T], shards: Sequence[int] | None = None,
                    inflight: list | None = None, parts: bool = False) -> list:
        """``fn`` on the given shards (all by default; partitions by slot with ``parts``) in parallel; each
        result, or the Exception it raised.

        The calls on other threads are added to ``inflight``: after an interrupt on this thread, which
        returns at once, the caller can wait for them before it tries again."""
        pool = self.parts if parts else self.shards
        chosen = [pool[i] for i in (range(len(pool)) if shards is None else shards)]

        def settle(s: ShardClient):
            try:
                return fn(s)
            except Exception as e:  # noqa: BLE001 -- handed back to the caller, which reports every shard's
                return e

        if len(chosen) == 1:
            return [settle(chosen[0])]
        rest = [self._pool.submit(settle, s) for s in chosen[1:]]
        if inflight is not None:
            inflight.extend(rest)
        # An interrupt (BaseException) on this thread leaves at once; close() then cancels the calls in flight.
        first = settle(chosen[0])
        return [first, *(f.result() for f in rest)]

    def close(self) -> None:
        """Close the channels, which ends every call in flight, then wait for the I/O threads."""
        for s in self.parts:
            s.close()
        self._pool.shutdown(wait=True)
