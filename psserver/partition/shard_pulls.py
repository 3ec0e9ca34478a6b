"""How a shard's slice is set and read: Init, and a pull's readiness, its snapshot and the message of a pull
that waited too long.

``Pulls`` is a room of ``Shard`` (psserver.partition.shard makes it), its own because reading the slice never decides
anything of a round: the lock-free reads here (``pull_ready``, ``try_acquire_snapshot``) are what the event loop
calls (see psserver.partition.shard's docstring on reads without the lock); the snapshots themselves live in
psserver.state.dense_slice.  Its own state is whether the shard stopped (every waiting pull is then answered).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from psserver.protocol.errors import InvalidRequest, JobMismatch
from psserver.protocol.rules import Mode

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class Pulls:
    """Init, and a pull's readiness, snapshot and wait message."""

    def __init__(self, shard, lock: threading.RLock, changed: Callable[[], None], info: Callable[..., None],
                 admission):
        """``shard``: the psserver.partition.shard.Shard whose slice this reads (not imported: it imports this), read
        at each call; ``admission``: its psserver.partition.shard_members.Admission (who may call)."""
        self.shard = shard
        self._lock, self._changed, self._info, self._admission = lock, changed, info, admission
        self._stopped = False

    def stop(self) -> None:
        """The shard stops: every pull is ready from now on (its waiter answers and goes)."""
        self._stopped = True

    def check_init_header(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """Refuse an Init on who sends it, before its payload is read. Returns False if already initialised."""
        self._admission.check_member(rank, trainer_id, fingerprint)
        if rank != 0:
            raise JobMismatch(f"Init came from rank {rank}, but only rank 0 initialises the shards")
        return self.shard.params is None

    def init(self, rank: int, trainer_id: str, fingerprint: str, values: torch.Tensor,
             take: bool = False) -> tuple[bool, int]:
        """Set the initial parameters; the first Init wins, later ones change nothing.  ``take``: the caller
        hands ``values`` over (a freshly decoded fp32 tensor) and the shard keeps it instead of copying it."""
        s = self.shard
        with self._lock:
            self.check_init_header(rank, trainer_id, fingerprint)
            if values.numel() != s.end - s.start:
                raise InvalidRequest(f"length is {values.numel()} elements but this shard's slice has "
                                     f"{s.end - s.start}")
            if s.params is not None:
                return False, s.version
            s.slice.init(values, take, s.job.optimizer)
            self._info("shard %d: initialised by rank %d with %d parameters", s.shard_id, rank, values.numel())
            self._changed()
            return True, s.version

    def pull_ready(self, min_version: int) -> bool:
        """May a pull for ``min_version`` be answered now? (Lock-free: the server's wait predicate.)"""
        s = self.shard
        job = s.job
        return self._stopped or (
            job is not None and s.params is not None and s.version >= min_version
            and (job.mode == Mode.ASYNC or s.started)
        )

    def acquire_snapshot(self, rank: int, trainer_id: str, fingerprint: str, wire: int) -> tuple[int, torch.Tensor]:
        """(version, snapshot in the wire dtype) for a pull; hand it back with ``release_snapshot``.

        The snapshot is never written while a pull streams it: an fp32 pull streams the live parameters and a
        step that finds them streamed moves them first (in sync mode that is rare: every pull of a round ends
        before the next can close); a reduced-precision pull streams a copy converted once per version.
        """
        with self._lock:
            self._admission.check_member(rank, trainer_id, fingerprint, need_params=True)
            return self.shard.slice.acquire(wire)

    def try_acquire_snapshot(self, wire: int) -> tuple[int, torch.Tensor] | None:
        """The fast path of ``acquire_snapshot`` for the event loop (caller checked membership); None: use the
        worker (psserver.state.dense_slice)."""
        return self.shard.slice.try_acquire(wire)

    def release_snapshot(self, snapshot: torch.Tensor) -> None:
        """A pull finished (or abandoned) streaming ``snapshot``; its memory may be written again."""
        self.shard.slice.release(snapshot)

    def pull_wait_message(self, min_version: int, timeout: float) -> str:
        s = self.shard
        if s.params is None:
            return f"{s.label} was not initialised within {timeout:.1f} s: is rank 0 running?"
        if not s.started:
            missing = s.enrolment.missing_registrations(s.job.num_trainers)
            return f"{s.label} still waits for ranks {missing}"
        return f"{s.label} is at version {s.version}, not {min_version}, after {timeout:.1f} s"
