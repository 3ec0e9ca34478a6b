"""Reply streams, bounded in time and in memory, and the connections that may open them.

Why a room of its own: a server-streaming reply (Pull, PullRows, PushPull, any new one) holds memory -- the
snapshot it streams, the rows it gathered -- until its client has taken the last chunk.  A client that stops
reading would hold it for ever: ``await context.write`` waits on HTTP/2 flow control, and no deadline of the
shard's ran past that point.  Here:

* ``ReplyStream`` wraps a call's context: each ``write`` is bounded by the call's deadline (``--max-call-seconds``
  or the client's, the earlier), so a stalled reader is cut with DEADLINE_EXCEEDED (``ReplyCut``) and the
  handler's ``finally`` releases what it held.
* ``ReplyLedger`` counts the bytes reply streams hold, per connection and for the shard, with caps: a reply
  that would pass one is refused RESOURCE_EXHAUSTED (``OverReplyCap``) naming the cap and the bytes held.  A
  snapshot streamed by many pulls is one buffer, so it is counted once (by key); a connection or a shard that
  holds nothing is always allowed one reply, so a slice larger than a cap can still be pulled.
* ``Connections`` counts the calls in flight per connection (``--max-calls-per-peer``), the connections with
  calls in flight (``--max-connections``) and health ``Watch`` streams (``--max-watch-streams``).

Refused, not queued: a legitimate trainer holds one reply per connection (a partitioned trainer has a
connection per partition), so a cap is reached only by clients that do not read what they asked for.
This module must not import torch (psserver.serving.health, which imports nothing heavy, uses ``Connections``).
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Callable, Hashable

from psserver.common.logsafe import counted, shorten
from psserver.protocol.errors import StreamTimeout, TooBusy


class ReplyCut(StreamTimeout):
    """A reply stream's reader did not take its chunks before the call's deadline (DEADLINE_EXCEEDED)."""


class OverReplyCap(TooBusy):
    """A reply would pass a cap on bytes held for unread replies (RESOURCE_EXHAUSTED)."""


class TooManyConnections(TooBusy):
    """A call from a further connection while ``--max-connections`` have calls in flight (RESOURCE_EXHAUSTED)."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class OverRequestCap(TooBusy):
    """A request would pass a cap on bytes held for requests being received (RESOURCE_EXHAUSTED)."""


class ReplyLedger:
    """Bytes held by reply streams not yet read, per connection and for the shard (on the event loop only)."""

    WHAT, PEER_FLAG, SHARD_FLAG, HINT = ("unread replies", "--max-reply-bytes-per-peer", "--max-reply-bytes",
                                         ": read the replies you asked for first")
    REFUSAL = OverReplyCap

    def __init__(self, per_peer_cap: int, shard_cap: int):
        self.per_peer_cap, self.shard_cap = per_peer_cap, shard_cap
        self.held_bytes = 0
        self._keys: dict[Hashable, list] = {}  # key -> [bytes, holds] for the shard
        self._peers: dict[str, dict[Hashable, int]] = {}  # peer -> key -> holds
        self._peer_bytes: dict[str, int] = {}

    def peer_bytes(self, peer: str) -> int:
        return self._peer_bytes.get(peer, 0)

    def hold(self, peer: str, key: Hashable, nbytes: int, force: bool = False) -> tuple[str, Hashable]:
        """Count ``nbytes`` under ``key`` for ``peer`` (nothing more if the key is held already); hand the
        result back to ``release``.  Raises OverReplyCap naming the cap and the bytes held (unless ``force``:
        memory already held, counted so that it shows)."""
        mine = self._peers.get(peer, {})
        new_shard = 0 if key in self._keys else nbytes
        new_peer = 0 if key in mine else nbytes
        held_peer = self.peer_bytes(peer)
        if not force and new_peer and held_peer and held_peer + new_peer > self.per_peer_cap:
            raise self.REFUSAL(
                f"connection {shorten(peer)} holds {_mib(held_peer)} of {self.WHAT}; {_mib(new_peer)} more "
                f"would pass the cap of {_mib(self.per_peer_cap)} ({self.PEER_FLAG}){self.HINT}")
        if not force and new_shard and self.held_bytes and self.held_bytes + new_shard > self.shard_cap:
            raise self.REFUSAL(
                f"the shard holds {_mib(self.held_bytes)} of {self.WHAT}; {_mib(new_shard)} more would pass "
                f"the cap of {_mib(self.shard_cap)} ({self.SHARD_FLAG})")
        entry = self._keys.setdefault(key, [nbytes, 0])
        entry[1] += 1
        self.held_bytes += new_shard
        mine = self._peers.setdefault(peer, mine)
        mine[key] = mine.get(key, 0) + 1
        self._peer_bytes[peer] = held_peer + new_peer
        return peer, key

    def release(self, token: tuple[str, Hashable]) -> None:
        peer, key = token
        entry, mine = self._keys[key], self._peers[peer]
        mine[key] -= 1
        if not mine[key]:
            del mine[key]
            self._peer_bytes[peer] -= entry[0]
            if not mine:
                del self._peers[peer], self._peer_bytes[peer]
        entry[1] -= 1
        if not entry[1]:
            del self._keys[key]
            self.held_bytes -= entry[0]


class RequestLedger(ReplyLedger):
    """Bytes held by requests being received -- a Step's parts kept until its stream ends, a row push's rows
    allocated for what its header declares -- per connection and for the shard: a client that opens streams and
    leaves them unfinished is refused RESOURCE_EXHAUSTED at its next one past a cap, before anything is
    allocated for it (the one request of a connection or a shard holding nothing always goes on)."""

    WHAT, PEER_FLAG, SHARD_FLAG, HINT = ("requests being received", "--max-request-bytes-per-peer",
                                         "--max-request-bytes", ": finish or cancel the calls you started first")
    REFUSAL = OverRequestCap


class RequestHolds:
    """One call's holds in the RequestLedger, given back together when the call ends (``release_all``)."""

    def __init__(self, ledger: RequestLedger, peer: str):
        self._ledger, self._peer, self._tokens = ledger, peer, []

    def hold(self, key: Hashable, nbytes: int) -> None:
        self._tokens.append(self._ledger.hold(self._peer, key, nbytes))

    def release_all(self) -> None:
        while self._tokens:
            self._ledger.release(self._tokens.pop())

    def __enter__(self) -> "RequestHolds":
        return self

    def __exit__(self, *exc) -> None:
        self.release_all()


class ReplyStream:
    """A server-streaming call's context whose writes end at ``deadline`` (loop time) and whose held bytes are
    counted in ``ledger`` until ``close``.  Everything else (``peer``, ``abort``, metadata) is the context's."""

    def __init__(self, context, deadline: float, ledger: ReplyLedger, gate=None):
        """``gate``: awaited before the first write (a hot standby's barrier, psserver.replication.shipper)."""
        self._context, self._deadline, self._ledger, self._gate = context, deadline, ledger, gate
        self.peer_name = context.peer() or "?"
        self._holds: list = []
        self._in_flight = None  # the message gRPC still holds after a cut, counted until the status is out
        self._timer = None  # fires at the deadline (armed at the first write)
        self._armed = self._fired = False
        self._writer: asyncio.Task | None = None  # the task waiting in a write now

    def __getattr__(self, name):
        return getattr(self._context, name)

    def hold(self, key: Hashable, nbytes: int, force: bool = False):
        """Count ``nbytes`` of memory this reply pins (see ReplyLedger.hold); released by ``release`` or
        ``close``, whichever comes first."""
        token = self._ledger.hold(self.peer_name, key, nbytes, force)
        self._holds.append(token)
        return token

    def release(self, token) -> None:
        if token in self._holds:
            self._holds.remove(token)
            self._ledger.release(token)

    def release_held(self) -> None:
        """The handler ended: what it held is free (its snapshot, its rows), all but a cut's in-flight message."""
        while self._holds:
            self._ledger.release(self._holds.pop())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.release_held()
        if self._in_flight is not None:
            self._ledger.release(self._in_flight)
            self._in_flight = None

    def _fire(self) -> None:
        """The deadline: a write still waiting is cut now; a later one is refused when it starts."""
        self._timer = None
        if self._writer is not None:
            self._fired = True
            self._writer.cancel()

    async def write(self, message, nbytes: int = 0) -> None:
        """``context.write`` that ends at the deadline: the reader stalled (flow control held the write) or the
        call is past its time.  ``nbytes``: the message's size, counted as held while gRPC holds it after a cut.
        One timer per stream, armed at the first write: a timer per chunk cost more than the rest of the bounds."""
        if self._gate is not None:
            gate, self._gate = self._gate, None
            await gate()
        loop = asyncio.get_running_loop()
        left = self._deadline - loop.time()
        if left <= 0:
            raise ReplyCut(self._cut_message())
        if self._timer is None and not self._armed:
            self._armed = True
            self._timer = loop.call_later(left, self._fire)
        self._writer = asyncio.current_task()
        try:
            await self._context.write(message)
        except asyncio.CancelledError:
            if not self._fired:
                raise  # the client went away: gRPC cancelled the call
            if hasattr(self._writer, "uncancel"):  # Python 3.11+: clear the cancellation the timer requested
                self._writer.uncancel()
            # gRPC still holds the message it could not send; it is counted until the status goes out.
            self._in_flight = self._ledger.hold(self.peer_name, ("in-flight", id(self)), nbytes, force=True)
            raise ReplyCut(self._cut_message()) from None
        finally:
            self._writer = None

    def _cut_message(self) -> str:
        return ("the reader did not take the reply before the call's deadline: the shard ends reply streams "
                "still unread at --max-call-seconds (or the client's deadline, if earlier)")


class Connections:
    """Calls in flight per connection, connections with calls in flight, and health Watch streams (on the
    event loop only).  ``count(name)``: the shard's counter, for each refusal."""

    def __init__(self, max_calls_per_peer: int, max_connections: int, max_watch_streams: int,
                 count: Callable[[str], None] = lambda name: None):
        self.max_calls_per_peer, self.max_connections = max_calls_per_peer, max_connections
        self.max_watch_streams, self._count = max_watch_streams, count
        self.calls: dict[str, int] = {}
        self.watch_streams = 0

    @contextmanager
    def call(self, peer: str):
        """One call of ``peer`` in flight: refused TooBusy past the per-connection cap, TooManyConnections when
        ``peer`` is a further connection past ``--max-connections``."""
        held = self.calls.get(peer, 0)
        if held >= self.max_calls_per_peer:
            self._count("refused_over_limit")
            raise TooBusy(f"connection {shorten(peer)} already has {counted(held, 'call')} in flight, the limit is "
                          f"{self.max_calls_per_peer} (--max-calls-per-peer)")
        if not held and len(self.calls) >= self.max_connections:
            self._count("refused_connections")
            raise TooManyConnections(f"{len(self.calls)} connections have calls in flight, the limit is "
                                     f"{self.max_connections} (--max-connections): call again later")
        self.calls[peer] = held + 1
        try:
            yield
        finally:
            self.calls[peer] -= 1
            if not self.calls[peer]:
                del self.calls[peer]

    @contextmanager
    def watch(self, peer: str):
        """One health Watch stream of ``peer``: a call of its connection too, and one of ``--max-watch-streams``."""
        if self.watch_streams >= self.max_watch_streams:
            self._count("refused_watch_streams")
            raise TooBusy(f"{counted(self.watch_streams, 'health Watch stream')} are open, the limit is "
                          f"{self.max_watch_streams} (--max-watch-streams): use Check, or Watch later")
        with self.call(peer):
            self.watch_streams += 1
            try:
                yield
            finally:
                self.watch_streams -= 1
