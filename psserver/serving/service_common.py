"""What the servicer's RPC handlers and its rooms share (psserver.serving.service; service_dense, service_rows and
service_step): the request stream reader with its idle and total deadlines, the wrapper through which every refusal
becomes its one status code (``_refusals``), and the checks of a caller's identity and a chunk header's fields.

Kept apart from the handlers so each RPC family's room reads alone; the rule that errors become status codes in
one place holds because every handler -- all on the servicer, each calling one room's method -- is wrapped by
``_refusals`` from here.  The wrappers read the servicer they wrap: its call slots (``slots``), ``count``,
``refusal_log``, ``shard``, ``replication``, ``replies`` and ``requests``.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import urllib.parse
from contextlib import ExitStack, asynccontextmanager

from psserver.common.logsafe import shorten
from psserver.partition.shard import Shard
from psserver.protocol import limits
from psserver.protocol.codec import (
    first_header,
)
from psserver.protocol.errors import (
    InvalidRequest,
    NotReady,
    PsError,
    StaleGradient,
    StreamTimeout,
    TooBusy,
    TooLarge,
    WaitTimeout,
)
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.serving.replies import ReplyCut, ReplyStream, RequestHolds

log = logging.getLogger("psserver.serving.service")

_OUTCOMES = {"applied": _pb.APPLIED, "accepted": _pb.ACCEPTED, "duplicate": _pb.DUPLICATE, "scaled": _pb.SCALED,
             "skipped": _pb.SKIPPED, "stale": _pb.STALE}


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


# Calls whose reply acknowledges nothing a standby must hold (psserver.replication.shipper): they never wait for it.
UNREPLICATED_CALLS = frozenset({"Heartbeat", "GetStats", "Reshard", "Handoff"})
# Calls that only show state (rows a pull creates are a function of seed and id): they wait for no shipment newer
# than the one whose capture found what they show (Replicator.barrier's ``read``).
READ_CALLS = frozenset({"Pull", "PullRows"})


def _refusals(method):
    """Turn PsError into context.abort with its code; count every refusal and log them at a bounded rate;
    count calls their clients abandoned."""

    acknowledges = method.__name__ not in UNREPLICATED_CALLS

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            reply = await method(self, request, context)
            if acknowledges and reply is not None and self.replication is not None:
                await self.replication.barrier()  # the standby holds what the reply acknowledges (docs/standby.md)
            return reply
        except asyncio.CancelledError:  # the client went away (or its deadline passed)
            _cancelled(self, method.__name__, context, "")
            raise
        except PsError as e:
            if isinstance(e, StreamEndedEarly) and hasattr(request, "__aiter__") and \
                    await _grace(self, e, context):
                _cancelled(self, method.__name__, context, str(e))  # not a refusal: nothing of it was applied
                raise asyncio.CancelledError from None
            code = e.code
            if e.trailers():  # what the client acts on (a reason, a stale push's version): psserver.protocol.rules
                context.set_trailing_metadata(e.trailers())
            if isinstance(e, WaitTimeout):  # a wait that ended, not bad input: trainers poll while peers start
                self.count("pull_wait_timeouts")
                self.refusal_log.log(logging.INFO, f"{method.__name__}:wait", "shard %d: %s", self.shard.shard_id, e)
            elif not isinstance(e, StaleGradient):  # a stale push is counted and logged by the shard (stale_dropped)
                self.count(f"refused_{code.name}")
                self.refusal_log.warning(f"{method.__name__}:{code.name}", "shard %d: %s refused with %s: %s",
                                         self.shard.shard_id, method.__name__, code.name, e)
            await context.abort(code, str(e))

    return wrapper


CANCEL_GRACE = 1.0  # seconds a stream that ended early waits for its call's cancellation (_client_cancelled)


class StreamEndedEarly(InvalidRequest):
    """A request stream that ended before its message was whole: its client closed it early (refused,
    INVALID_ARGUMENT) or cancelled the call -- gRPC ends a cancelled call's request stream as if it were closed."""


async def _client_cancelled(context) -> bool:
    """Whether the client cancelled the call whose request stream just ended early.  gRPC tells the handler so
    by cancelling its task a loop turn or more after the stream's end (``context.cancelled()`` stays False), and
    there is nothing to await but that: wait for it at most CANCEL_GRACE seconds, so a cancelled push is counted
    as one, not as bad input; a client that closed its stream early gets its refusal that much later."""
    try:
        await asyncio.sleep(CANCEL_GRACE)
    except asyncio.CancelledError:
        return True
    return context.cancelled()


async def _grace(service, e: StreamEndedEarly, context) -> bool:
    """``_client_cancelled`` for a request stream that ended early, held as a call of its connection: the
    handler's own slot was given back when it raised, and a client closing streams early at a high rate held a
    handler each for CANCEL_GRACE outside --max-calls-per-peer -- with what it had read (a Step's parts, up to
    --max-push-bytes), kept by the exception's frames.  The frames go first; a connection at its cap gets no
    grace (refused at once, counted ``refused_over_limit`` too).  (Unary calls, whose request came whole, never
    wait: ``_refusals``.)"""
    e.__traceback__ = None  # the handler's frames, and the chunks they read, are freed now, not after the wait
    with ExitStack() as held:
        try:
            held.enter_context(service.slots.peer_slot(context))
        except TooBusy:
            return False
        return await _client_cancelled(context)


def _cancelled(service, name: str, context, cut: str) -> None:
    """A call its client cancelled: counted (``calls_cancelled``; ``streams_cancelled`` when its request stream was
    cut before the shard read it whole -- nothing of it was applied) shard-wide (every layout's), and logged at a
    bounded rate: a push its trainer gave up on is never lost silently."""
    service.count("calls_cancelled")
    if cut:
        service.count("streams_cancelled")
    service.refusal_log.log(logging.INFO, f"{name}:cancelled", "shard %d: %s cancelled by its client %s%s",
                            service.shard.shard_id, name, shorten(context.peer() or "?"),
                            f" before the shard read its stream whole ({shorten(cut, 160)}): nothing of it applied"
                            if cut else "")


def _reply_stream(method):
    """Every server-streaming handler (Pull, PullRows, PushPull; wrap new ones the same way, inside
    ``_refusals``): a call of its connection, a ``ReplyStream`` for a context -- writes that end at the call's
    deadline, bytes held counted per connection and for the shard -- and, when a reader stalled past the
    deadline, DEADLINE_EXCEEDED, counted (``reply_streams_cut``) and logged at a bounded rate.  The connection's
    call and the message gRPC still holds stay counted until that status is out (or the client is gone)."""

    gate_read = method.__name__ in READ_CALLS

    @functools.wraps(method)
    async def wrapper(self, request, context):
        with self.slots.peer_slot(context):
            gate = None if self.replication is None else \
                functools.partial(self.replication.barrier, read=True) if gate_read else self.replication.barrier
            stream = ReplyStream(context, self.slots.deadline(context), self.replies, gate=gate)
            stream.requests = RequestHolds(self.requests, stream.peer_name)  # what the request holds while read
            try:
                return await method(self, request, stream)
            except ReplyCut as e:
                stream.release_held()  # the handler's snapshot or rows are free now; the status may wait
                self.count("reply_streams_cut")
                self.refusal_log.warning(f"{method.__name__}:cut", "shard %d: %s reply to %s cut: %s",
                                         self.shard.shard_id, method.__name__, shorten(stream.peer_name), e)
                await context.abort(e.code, str(e))
            finally:
                stream.requests.release_all()
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
            raise StreamEndedEarly("the stream is empty: the first chunk must carry a header")
        return first, first_header(first)


async def _read_all(reader: _StreamReader):
    """A request stream's messages through ``reader`` (its deadlines), each decoded or refused."""
    while (chunk := await reader.next()) is not None:
        yield _decoded(chunk)


def peer_host(peer: str) -> str:
    """The host part of gRPC's ``context.peer()`` ("ipv4:10.0.0.7:5000" -> "10.0.0.7"): what a caller's
    strikes are kept by (a process reconnects from another port)."""
    kind, _, rest = peer.partition(":")
    return peer if kind == "unix" else urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]")


def _is_loopback(peer: str) -> bool:
    """Whether gRPC's ``context.peer()`` ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000" -- brackets percent-encoded
    --, "unix:...") is this host."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    host = urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


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
    return part.admission.is_member(request.rank, request.trainer_id, request.fingerprint)


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


def require_handoffs(handoffs):
    """A live re-shard's calls (psserver.resharding.handoff.shard_ops), or NotReady where the servicer was made without."""
    if handoffs is None:
        raise NotReady("handoffs is None but a live re-shard needs a shard process (psserver.serving.server)")
    return handoffs


@asynccontextmanager
async def _no_slot():
    """In place of a rank slot a call does not take (a Step holds one for all its parts)."""
    yield


def _push_reply(r, layout_epoch: int) -> _pb.PushRowsReply:
    """A row push's reply, naming the newest layout as a dense reply does (a table-only shard teaches a switch)."""
    return _pb.PushRowsReply(outcome=_OUTCOMES[r.outcome], version=r.version, staleness=r.staleness,
                             rows_applied=r.rows_applied, rows_stale=r.rows_stale, layout_epoch=layout_epoch)


def _check_pull_bytes(n: int, dim: int, max_bytes: int) -> None:
    """Refuse a row pull whose reply (and the rows it may create) would pass the shard's per-call byte limit
    (limits.MAX_ROWS_REPLY_BYTES, or --max-push-bytes if lower)."""
    if n * dim * 4 > max_bytes:
        raise TooLarge(f"the pull asks for {n} rows of dim {dim} ({n * dim * 4} bytes), over this shard's limit "
                       f"of {max_bytes} bytes for one PullRows reply: split the ids")
