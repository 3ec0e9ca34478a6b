"""Who is in the job: registered ranks, their leases, who left.

Kept apart from the shard's tensors on purpose: a heartbeat only renews a
lease here, under this object's own lock, which is never held while tensors
are touched -- so heartbeats and lease checks never wait behind an optimizer
step.  Lock order: ``Shard._lock`` may be held while taking ``Membership._lock``,
never the reverse.

Per-rank state is bounded by the job's ``num_trainers`` (itself capped) and
freed when a rank leaves: a rank that said goodbye is gone, and must register
again to push.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from psserver.common.logsafe import shorten
from psserver.protocol.errors import NotRegistered, Superseded
from psserver.state.modes import expired_ranks, next_lease_expiry


@dataclass(frozen=True)
class MemberView:
    """A consistent copy for decisions and stats."""

    live: frozenset[int]
    registered: frozenset[int]  # ranks registered at least once in this job
    left: frozenset[int]


class Membership:
    def __init__(self, clock: Callable[[], float], lease_timeout: float):
        self._clock = clock
        self.lease_timeout = lease_timeout
        self._lock = threading.Lock()
        self._trainers: dict[int, str] = {}  # rank -> trainer id of its newest registration
        self._live: set[int] = set()
        self._registered: set[int] = set()
        self._left: set[int] = set()
        self._last_seen: dict[int, float] = {}
        self._view: MemberView | None = None  # cached until the membership changes (heartbeats do not)
        self.changes = 0  # membership changes so far: what a read shows of it is no newer than a count (Shard.exposed)

    def reset(self) -> None:
        with self._lock:
            self._trainers.clear()
            self._live.clear()
            self._registered.clear()
            self._left.clear()
            self._last_seen.clear()
            self._changed()

    def _changed(self) -> None:
        self._view = None
        self.changes += 1

    def register(self, rank: int, trainer_id: str) -> str | None:
        """Join (or rejoin) ``rank`` as ``trainer_id``; returns the id it replaces, if any."""
        with self._lock:
            previous = self._trainers.get(rank)
            self._trainers[rank] = trainer_id
            self._live.add(rank)
            self._registered.add(rank)
            self._left.discard(rank)
            self._last_seen[rank] = self._clock()
            self._changed()
            return previous

    def leave(self, rank: int) -> int:
        """``rank`` said goodbye: forget it (it must register again to push). Returns the live count left."""
        with self._lock:
            self._trainers.pop(rank, None)
            self._last_seen.pop(rank, None)
            self._live.discard(rank)
            self._left.add(rank)
            self._changed()
            return len(self._live)

    def check(self, rank: int, trainer_id: str, shard_id: int) -> bool:
        """Refuse strangers and fenced-off processes; renew the caller's lease (any RPC is a heartbeat).

        Returns True when the rank was silent past its lease and is live again.
        """
        with self._lock:
            current = self._trainers.get(rank)
            if current is None:
                if rank in self._left:
                    raise NotRegistered(f"rank {rank} left the job on shard {shard_id}: register again to push")
                raise NotRegistered(f"rank {rank} is not registered with shard {shard_id}: register first")
            if current != trainer_id:
                raise Superseded(
                    f"rank {rank} is registered as {shorten(current)}, not {shorten(trainer_id)}: a newer trainer "
                    "took this rank; this process is fenced off and should stop"
                )
            self._last_seen[rank] = self._clock()
            if rank not in self._live:
                self._live.add(rank)
                self._changed()
                return True
            return False

    def holds(self, rank: int, trainer_id: str) -> bool:
        """Is ``rank`` registered as ``trainer_id`` (live or silent, not left)?  A read: renews no lease."""
        with self._lock:
            return self._trainers.get(rank) == trainer_id

    def expire(self) -> list[tuple[int, float]]:
        """Drop live ranks silent past the lease; returns (rank, seconds silent) for each."""
        with self._lock:
            now = self._clock()
            gone = sorted(expired_ranks(frozenset(self._live), self._last_seen, self.lease_timeout, now))
            for rank in gone:
                self._live.discard(rank)
            if gone:
                self._changed()
            return [(rank, now - self._last_seen[rank]) for rank in gone]

    def next_expiry(self) -> float | None:
        with self._lock:
            return next_lease_expiry(frozenset(self._live), self._last_seen, self.lease_timeout)

    def view(self) -> MemberView:
        with self._lock:
            if self._view is None:
                self._view = MemberView(frozenset(self._live), frozenset(self._registered), frozenset(self._left))
            return self._view

    def restore(self, trainers: dict[int, str]) -> None:
        """After a restart: the checkpoint's members, live with fresh leases (a dead one expires as usual)."""
        with self._lock:
            now = self._clock()
            for rank, trainer_id in trainers.items():
                self._trainers[rank] = trainer_id
                self._live.add(rank)
                self._registered.add(rank)
                self._last_seen[rank] = now
            self._changed()

    def members(self) -> dict[int, str]:
        with self._lock:
            return dict(self._trainers)
