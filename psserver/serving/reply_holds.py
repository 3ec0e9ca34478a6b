"""Replies held over a live re-shard's block (docs/design/handoff-io.md, "Round R-1's replies are held").

Between COMMIT R and DECIDE, a reply that would hand out version R or later in the old layout (the weights of a
pull, PushPull or Step, or a Push's reply naming R) waits here.  On a switch it goes out after the new layout is
installed, so it names it (``layout_epoch``) and the trainer sends its step of base R straight to the new layout:
no refusal, no retry, no re-route.  On an abort it goes out as usual.  The weights it carries are the same
either way: the old piece at R is the tombstone, and R is what the new layout starts from.

A held reply is a future on the event loop (like psserver.serving.runtime.VersionWaiters), not a sleeping thread: the
plan (psserver.resharding.handoff.shard_ops) sets the hold from the state worker at COMMIT and releases it on the loop, so a reply
checked on the loop sees the hold and its release in one order.  Each wait is bounded by the hand-off timeout
and by the call's deadline; past either the reply goes out as usual in the old layout (counted
``handoff_reply_holds_expired``), and a push of base R that follows is refused ``handoff`` until DECIDE
(psserver.resharding.layout_host.LayoutHost.push_part).
"""

from __future__ import annotations

import asyncio
import logging
import threading

log = logging.getLogger(__name__)


class ReplyHolds:
    """Per partition: R, and the replies waiting for its DECIDE."""

    def __init__(self, loop: asyncio.AbstractEventLoop, loop_thread: int):
        self._loop, self._loop_thread = loop, loop_thread
        self._held: dict[object, tuple[int, float]] = {}  # partition -> (R, the hand-off timeout)
        self._waiting: dict[object, set[asyncio.Future]] = {}
        self._logged: set[tuple[int, int, int]] = set()  # (shard, partition, R): one line per round

    def hold(self, part, version: int, timeout: float) -> None:
        """From COMMIT on (any thread): replies handing out ``version`` or later from ``part`` wait."""
        self._held[part] = (version, timeout)

    def release(self, part) -> None:
        """DECIDE (any thread; after a switch's install): the held replies go out, on the loop."""
        if threading.get_ident() == self._loop_thread:
            self._release(part)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._release, part)

    def _release(self, part) -> None:
        self._held.pop(part, None)
        for fut in self._waiting.pop(part, set()):
            if not fut.done():
                fut.set_result(True)

    def held(self, part, version: int) -> int | None:
        """R, if a reply handing out ``version`` from ``part`` must wait now (on the loop)."""
        found = self._held.get(part)
        return found[0] if found is not None and version >= found[0] else None

    async def wait(self, part, version: int, deadline: float) -> None:
        """Hold a reply handing out ``version`` until DECIDE, the hand-off timeout or ``deadline`` (loop time)."""
        found = self._held.get(part)
        if found is None or version < found[0]:
            return
        R, timeout = found
        part.count("handoff_replies_held")
        key = (part.shard_id, part.partition, R)
        if key not in self._logged:
            self._logged.add(key)
            log.info("%s: replies handing out version %d wait for the hand-off's DECIDE (R=%d, at most %gs)",
                     part.label, version, R, timeout)
        fut = self._loop.create_future()
        self._waiting.setdefault(part, set()).add(fut)
        try:
            await asyncio.wait_for(fut, max(0.0, min(timeout, deadline - self._loop.time())))
        except asyncio.TimeoutError:
            part.count("handoff_reply_holds_expired")
            log.warning("%s: a reply handing out version %d waited %gs for the hand-off's DECIDE (R=%d) and goes "
                        "out in the old layout; a push of base %d is refused 'handoff' until DECIDE", part.label,
                        version, timeout, R, R)
        finally:
            waiting = self._waiting.get(part)
            if waiting is not None:
                waiting.discard(fut)
