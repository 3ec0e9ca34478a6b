"""A bounded window of pushes in flight, acknowledged in the background (async ``push_window=W``).

Transport-agnostic: a push is a ``send`` callable that sends it -- or sends it again after a failure -- and
returns its acknowledgement.  Sending again is safe because whoever builds ``send`` fixes its sequence numbers
before handing it over (the shards answer a number they already applied DUPLICATE: psserver.state.modes
.decide_sequence keeps a window of numbers for exactly this).  The window only bounds, starts, collects and
retries; what a push carries and what an acknowledgement means belong to the caller (trainer.stepping.windowed for the
dense exchange; a fused step RPC can hand in its own ``send``).

``submit`` sends a push and returns once at most W-1 pushes are unacknowledged, so at most W are ever on the
wire: W=1 is the plain step (its own push acknowledged before it returns); with W>1 a submit that finds W
unacknowledged waits (``full_waits``) for one of them.  A push that failed
stays in the window, holding its place, until ``retry_failed`` sends it again under the same numbers or
``abandon_failed`` drops it; ``drain`` waits for every push (flush, close, leave).
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable


class WindowFailed(RuntimeError):
    """Pushes of the window failed for good; they stay in it until retried or abandoned.
    ``errors``: push number -> its error."""

    def __init__(self, errors: dict[int, BaseException]):
        self.errors = errors
        first = errors[min(errors)]
        super().__init__(f"{len(errors)} push(es) of the window failed ({', '.join(map(str, sorted(errors)))}); "
                         f"the first: {first}")


@dataclass
class Push:
    """One push in the window: its number (1, 2, ... in order of submission), how to send it, and its fate."""

    number: int
    send: Callable[[], object]
    future: Future | None = None
    error: BaseException | None = None  # failed for good (until retried)
    reported: bool = False  # its failure was raised once already


@dataclass
class WindowStats:
    submitted: int = 0
    acknowledged: int = 0
    full_waits: int = 0  # submits that found W pushes unacknowledged and waited for the oldest
    retried: int = 0
    abandoned: int = 0
    max_in_flight: int = 0


class PushWindow:
    """Up to ``size`` pushes unacknowledged at once; ``start(fn)`` runs ``fn`` in the background (a pool's
    submit); ``on_ack(number, result)`` is called on the thread that collects an acknowledgement."""

    def __init__(self, size: int, start: Callable[[Callable[[], object]], Future],
                 on_ack: Callable[[int, object], None] = lambda n, r: None):
        if size < 1:
            raise ValueError(f"push_window is {size} but must be 1 or more")
        self.size, self._start, self._on_ack = size, start, on_ack
        self._pushes: list[Push] = []  # unacknowledged, oldest first
        self._lock = threading.Lock()
        self.stats = WindowStats()

    @property
    def in_flight(self) -> int:
        """Pushes sent and not yet acknowledged (failed ones included: they hold their place)."""
        return len(self._pushes)

    def failed(self) -> list[Push]:
        return [p for p in self._pushes if p.error is not None]

    def submit(self, send: Callable[[], object]) -> int:
        """Send a new push, then wait until at most W-1 pushes are unacknowledged; returns its number.  A failure
        found before it is sent is raised (WindowFailed) without sending it: the caller still holds it; so is
        one raised before and neither retried nor abandoned since (no new push overtakes a failed one)."""
        self._collect(block=False)
        if self.failed():
            raise WindowFailed({p.number: p.error for p in self.failed()})
        self.stats.submitted += 1
        push = Push(self.stats.submitted, send)
        self._pushes.append(push)
        push.future = self._start(send)
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._pushes))
        if len(self._pushes) >= self.size:
            self.stats.full_waits += self.size > 1  # (W=1 always waits: that is the plain step, not a full window)
            while len(self._pushes) >= self.size:
                self._collect(block=True)
        return push.number

    def wait_room(self) -> None:
        """Wait until at most W-1 pushes are unacknowledged (a submit's wait, for a push already handed in)."""
        while len(self._pushes) >= self.size:
            self._collect(block=True)

    def drain(self) -> None:
        """Wait for every push in flight; WindowFailed if some failed (they stay, to be retried)."""
        while any(p.error is None for p in self._pushes):
            self._collect(block=True)
        self._raise_new_failures()

    def retry_failed(self) -> int:
        """Send the failed pushes again (same ``send``, so the same sequence numbers); returns how many."""
        again = self.failed()
        for p in again:
            p.error, p.reported = None, False
            p.future = self._start(p.send)
        self.stats.retried += len(again)
        return len(again)

    def abandon_failed(self) -> list[int]:
        """Drop the failed pushes (the caller counts them as lost); returns their numbers."""
        dropped = [p.number for p in self.failed()]
        self._pushes = [p for p in self._pushes if p.error is None]
        self.stats.abandoned += len(dropped)
        return dropped

    def _collect(self, block: bool) -> None:
        """Take in the acknowledgements that came (block: at least one more settles first).  Failed pushes
        hold their place, so a full window of failures raises instead of waiting forever."""
        pending = [p.future for p in self._pushes if p.error is None]
        if block:
            if not pending:
                self._raise_new_failures(always=True)
            futures_wait(pending, return_when=FIRST_COMPLETED)
        for p in list(self._pushes):
            if p.error is not None or not p.future.done():
                continue
            error = p.future.exception()
            if error is not None:
                p.error = error
                continue
            self._pushes.remove(p)
            self.stats.acknowledged += 1
            self._on_ack(p.number, p.future.result())
        self._raise_new_failures()

    def _raise_new_failures(self, always: bool = False) -> None:
        fresh = [p for p in self._pushes if p.error is not None and (always or not p.reported)]
        if fresh:
            for p in fresh:
                p.reported = True
            raise WindowFailed({p.number: p.error for p in fresh})
