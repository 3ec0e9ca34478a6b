"""State digests (``GetStats`` ``with_digest``) at most one at a time per partition, callers sharing them.

A digest is a pass over the whole state, tables included, on the state worker -- seconds on a big table.  Before,
every caller's digest was its own pass: a member (or, on a shard with a token, any caller) asking in a loop from
64 calls of a connection queued 64 passes ahead of every push.  Now a partition runs one digest at a time, and
callers who ask while one runs share the *next* one, which starts after it: each still gets a digest of the state
after it asked (never an older one), and the worker runs at most one digest between any two turns of other work
(docs/design/attacks-2026-11-24.md).  Counted: ``state_digest_calls``, ``state_digests`` (passes run) and
``state_digests_shared`` (callers who rode on a pass another caller started).
"""

from __future__ import annotations

import asyncio
from typing import Callable


class _Slot:
    def __init__(self):
        self.running: asyncio.Future | None = None  # the pass on the worker now
        self.queued: asyncio.Future | None = None  # the next pass: callers who asked while one ran


class DigestGate:
    """``digest(part)``: ``part.state_digest()`` through ``offload`` (the state worker), one pass at a time."""

    def __init__(self, offload: Callable[..., asyncio.Future]):
        self.offload = offload
        self._slots: dict[object, _Slot] = {}

    async def digest(self, part) -> str:
        slot = self._slots.setdefault(part, _Slot())
        part.count("state_digest_calls")
        if slot.queued is None:
            slot.queued = asyncio.ensure_future(self._next(slot, part))
        else:
            part.count("state_digests_shared")
        return await asyncio.shield(slot.queued)  # a caller that goes away leaves the pass to the others

    async def _next(self, slot: _Slot, part) -> str:
        if slot.running is not None:
            await asyncio.wait([slot.running])  # its end, not its result (a failed pass is its callers' to see)
        slot.queued = None  # a caller from now on asked after this pass began: it waits for the next
        slot.running = fut = self.offload(part.state_digest)
        part.count("state_digests")
        try:
            return await fut
        finally:
            if slot.running is fut:
                slot.running = None
