"""A shard's checkpoints: when one is due, the writer thread that writes it, the final one at shutdown, and
finding the newest valid one at ``--restore``.

A room of ``Shard`` (psserver.partition.shard): the shard captures its state (each of its rooms saves its own part) and
restores it; this room decides when and where, and counts what it wrote, superseded or skipped.  It also holds
the checkpoints a step made due while a push (psserver.partition.shard_pushes) or a Step's trip
(psserver.serving.step_trip) is under way, and takes them once the push's books, or the trip's table pushes, are written.  In a later
layout (psserver.resharding.layout_host) every state it writes carries that layout's timeline, so ``--restore`` can serve
the layout again.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Callable

from psserver.common.logsafe import counted
from psserver.state.checkpoint import Checkpointer, CheckpointWriter, ShardState

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class ShardCheckpoints:
    """The checkpoints of shard ``shard_id`` (none when ``checkpointer`` is None)."""

    def __init__(self, shard_id: int, checkpointer: Checkpointer | None, counters: Counter):
        self.shard_id = shard_id
        self.checkpointer = checkpointer
        self._counters = counters
        self._writer = CheckpointWriter(checkpointer, self._written) if checkpointer is not None else None
        self.layouts: list | None = None  # the layout timeline stamped on every state (None: the first layout)
        self._in_push: list[int] | None = None  # versions a push's step made: checkpointed after its books
        self._in_trip: list[int] | None = None  # ... and, in a Step's trip, after its table pushes too
        if checkpointer is not None and checkpointer.orphans_removed:
            counters["checkpoint_orphans_removed"] += checkpointer.orphans_removed

    def _written(self, ok: bool) -> None:
        self._counters["checkpoints_written" if ok else "checkpoint_failures"] += 1  # atomic under the GIL

    def due(self, version: int) -> bool:
        """Whether the step that makes ``version`` hands a capture to the writer (``after_step``)."""
        return self._writer is not None and self.checkpointer.due(version)

    def after_step(self, version: int, capture: Callable[[], ShardState]) -> None:
        """A step made ``version``: hand a capture of the state to the writer if a checkpoint is due."""
        if self.due(version):
            self.now(capture)

    def step_made(self, version: int, capture: Callable[[], ShardState]) -> None:
        """A step made ``version``: ``after_step`` now, or, during a push (``hold_push``), once the push is booked."""
        if self._in_push is not None:
            self._in_push.append(version)  # the push takes it after its books (take_held)
        else:
            self.after_step(version, capture)

    def hold_push(self) -> None:
        """A push is carried out: hold the checkpoints its step makes due until ``take_held``."""
        self._in_push = []

    def take_held(self, capture: Callable[[], ShardState]) -> None:
        """A checkpoint due at a version the push's step made, taken once the push's acknowledgement and claim
        are booked: restored, that version is the state after the push (its retry DUPLICATE, its grant kept).
        In a Step's trip (``after_trip``) it waits for the trip's end."""
        due, self._in_push = self._in_push or [], None
        if self._in_trip is not None:
            self._in_trip += due
            return
        for version in due:
            self.after_step(version, capture)

    @contextlib.contextmanager
    def after_trip(self, capture: Callable[[], ShardState]):
        """A Step's trip (psserver.serving.step_trip): a checkpoint its dense push makes due is taken once the
        trip's table pushes are applied too.  Taken between them, it held the sync tables' round half pushed (the
        dense round closed, this trainer's table pushes not in yet); restored, that round paired each trainer's
        later pushes one round apart and a prefetching job waited for ever (tests/cluster/test_sparse_faults.py)."""
        self._in_trip = []
        try:
            yield
        finally:
            due, self._in_trip = self._in_trip, None
            for version in due:
                self.after_step(version, capture)

    def now(self, capture: Callable[[], ShardState]) -> None:
        """Hand a capture to the writer whatever the version: a layout just installed writes its state at once,
        so a crash before its first due step finds the newest layout on disk."""
        if self._writer is not None:
            if self._writer.submit(self._stamped(capture())):
                self._counters["checkpoints_superseded"] += 1

    def _stamped(self, state: ShardState) -> ShardState:
        state.layouts = self.layouts
        return state

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def final(self, state: ShardState | None) -> None:
        """On shutdown: stop the writer, then write ``state`` (None: nothing to write) at once."""
        self._writer.stop()
        if state is not None:
            self._writer.write_now(self._stamped(state))

    def load_latest(self) -> tuple[ShardState | None, str]:
        """The newest valid checkpoint (None if there is none) and a note of the damaged files skipped."""
        state, skipped = self.checkpointer.load_latest()
        self._counters["checkpoints_skipped_damaged"] += len(skipped)
        self.layouts = state.layouts if state is not None else None  # written again with what it wrote
        if state is None:
            log.warning("shard %d: --restore found no valid checkpoint in %s; starting empty",
                        self.shard_id, self.checkpointer.directory)
        return state, f"{counted(len(skipped), 'damaged file')} skipped"

    def restored(self, version: int) -> None:
        """The shard took a state of ``version``: write nothing older than it."""
        if self.checkpointer is not None:
            self.checkpointer.last_written = max(self.checkpointer.last_written, version - 1)
