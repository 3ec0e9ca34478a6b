"""A Step's reply in one message, when the trainer asked for it (StepChunk.one_reply; issue 21).

Why a room of its own: every reply message costs gRPC Python a write on the shard (an event-loop round for the
write and its completion) and a read on the trainer, and a small step's reply was a message a part -- the dense
weights and each table's rows -- where its request was already one message (StepChunk.more).  Here the parts'
writers (psserver.serving.service_step._PartStream) write into a ``OneReply`` instead of the call: each message is
serialized as it is written (a dense reply's chunks are views of a pull snapshot released after its last write)
and kept; once every part is done, ``flush`` writes them as one message.  Bounded: when the kept bytes would
pass ``limit`` (psserver.protocol.limits.ONE_REPLY_BYTES, or half the shard's message limit if less) what was
kept goes out as the stream it would have been, in order, and the rest streams as without one_reply.  The bound
is the protocol's, not a flag's: a trainer that knows its reply is under it reads the reply with a unary call
(trainer.stepping.step_call).
Counted: ``step_replies_packed``, ``step_replies_over_limit``.
"""

from __future__ import annotations

from typing import Callable

from psserver.protocol.errors import TooLarge
from psserver.protocol.stepwire import pack_serialized, serialize_step

MORE_OVERHEAD = 6  # a `more` entry's tag and length varint (at most 1 + 5 bytes) on top of the message


class OneReply:
    """A Step call's reply stream that packs its messages into one (see the module's docstring); everything but
    ``write`` and ``flush`` is the call's ReplyStream's."""

    def __init__(self, stream, limit: int, count: Callable[[str], None], may_stream: bool = True):
        self._stream, self._limit, self._count = stream, limit, count
        self._may_stream = may_stream  # False: a unary call's reply (StepOnce), which cannot fall back to a stream
        self._kept: list[bytes] | None = []  # None once streaming
        self._bytes = 0

    def __getattr__(self, name):
        return getattr(self._stream, name)

    @property
    def streaming(self) -> bool:
        return self._kept is None

    async def write(self, message, nbytes: int = 0) -> None:
        """Keep ``message`` (serialized now); past the limit, write what was kept and stream from here on."""
        if self._kept is None:
            await self._stream.write(message, nbytes)
            return
        data = serialize_step(message)
        self._kept.append(data)
        self._bytes += len(data) + MORE_OVERHEAD
        if self._bytes > self._limit:
            if not self._may_stream:  # a StepOnce, bounded before it ran (the headers cannot pass the limit)
                raise TooLarge(f"the one-message reply holds {self._bytes} bytes so far, over the limit of "
                               f"{self._limit} bytes")
            kept, self._kept = self._kept, None
            self._count("step_replies_over_limit")
            for m in kept:
                await self._stream.write(m, len(m))

    async def flush(self) -> None:
        """Every part is done: what was kept, as one message (nothing if it streamed or nothing was written)."""
        data = self.take()
        if data is not None:
            await self._stream.write(data, len(data))

    def take(self) -> bytes | None:
        """What was kept, as one message's bytes (counted), or None if it streamed or nothing was written: a
        StepOnce's reply (psserver.serving.service_step), which returns it instead of writing it."""
        if not self._kept:
            return None
        kept, self._kept = self._kept, None
        self._count("step_replies_packed")
        return pack_serialized(kept)
