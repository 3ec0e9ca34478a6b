"""A shard's rounds: the tick that expires leases and closes a round that is due, closing a round into one
optimizer step, and the rate of that step.

``Rounds`` is a room of ``Shard`` (psserver.partition.shard makes it), its own because when a round closes is decided by
psserver.state.modes over a ``RoundView`` and carried out here alone: the step, the live re-shard's round listener,
the counters and the line for a round closed without everyone, and the checkpoint a step makes due.  It holds no
state of the job: the open round, the slice and the job are the shard's, read at each call (a new job replaces
them); what it calls -- the lock, the clock, the wake-up -- it is handed.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from psserver.common.logsafe import counted
from psserver.members.enrolment import MAX_MISSING_LISTED
from psserver.protocol.epochs import lr_factor
from psserver.protocol.schedules import lr_at
from psserver.state import modes

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class Rounds:
    """Ticks, closing a round, one optimizer step at the schedule's rate: over ``shard``'s open round
    (``shard.round``, not to be confused with this room, ``shard.rounds``)."""

    def __init__(self, shard, lock: threading.RLock, clock: Callable[[], float], changed: Callable[[], None]):
        """``shard``: the psserver.partition.shard.Shard whose job this closes rounds of (not imported: it imports this)."""
        self.shard = shard
        self._lock, self._clock, self._changed = lock, clock, changed
        self._enrolment, self._counters = shard.enrolment, shard.counters

    def tick(self) -> float | None:
        """Expire silent trainers' leases and close a round that is due; returns the next deadline (clock time)."""
        s = self.shard
        with self._lock:
            if s.job is None:
                return None
            gone = self._enrolment.expire(s.version)
            if s.params is not None:
                self.close_if_due()
            if s.tables.close_due(self._enrolment.table_members(), self._clock()) or gone:
                self._changed()
            deadlines = [*self._enrolment.deadlines(), *s.tables.deadlines(self._enrolment.table_members())]
            if s.params is not None:
                deadlines.append(modes.round_deadline(s.mode_config(), self.view()))
            deadlines = [d for d in deadlines if d is not None]
            return min(deadlines) if deadlines else None

    def close_if_due(self) -> None:
        """Close the open round if the mode says it is due now (a tick, a leave, a join)."""
        cfg = self.shard.mode_config()
        reason = modes.decide_tick(cfg, self.view(), self._clock()) if cfg else None
        if reason is not None:
            self.close_round(reason)

    def close_round(self, reason: modes.CloseReason) -> None:
        """Average the open round (weighted by samples) and take one optimizer step -- or, when every
        gradient in it was skipped, advance the version without one, so its waiters go on."""
        s = self.shard
        n = len(s.round.contributors)
        missing = (sorted(self.view().live - s.round.contributors)
                   if reason is not modes.CloseReason.ALL_ARRIVED else [])
        average = s.round.average() if modes.round_takes_step(s.round.weight) else None
        # Reset before the step: a checkpoint the step takes must not hold this round as still open (a
        # --restore would apply it a second time).
        s.round.reset()
        lr = self._lr() if average is not None and s.round_listener is not None else None
        if average is not None:
            self.apply_step(average)
        else:
            s.slice.advance()
            self._counters["rounds_without_step"] += 1
        if s.round_listener is not None:  # after the step: a range copied again is at the new version
            s.round_listener(s, s.version - 1, average, lr)
        self._counters[f"rounds_{reason.value}"] += 1
        if reason is not modes.CloseReason.ALL_ARRIVED:
            log.info("shard %d: round %d closed by %s with %s; missing ranks %s",
                     s.shard_id, s.version - 1, reason.value, counted(n, "gradient"),
                     missing[:MAX_MISSING_LISTED])
        self._changed()

    def apply_push_step(self, grad: torch.Tensor) -> None:
        """An async push's own step.  During a live re-shard each one is a forward (its gradient and lr, as a sync
        round's average is), so the destination replays it (docs/live-reshard.md stage 8)."""
        s = self.shard
        lr = self._lr() if s.round_listener is not None else None
        self.apply_step(grad)
        if s.round_listener is not None:  # after the step, as close_round's (the log clones the range)
            s.round_listener(s, s.version - 1, grad, lr)

    def apply_step(self, grad: torch.Tensor) -> None:
        """One optimizer step at the schedule's rate (psserver.state.dense_slice), then a checkpoint if one is due
        (held, during a push, until the push is booked: ShardCheckpoints.step_made)."""
        s = self.shard
        elapsed = s.slice.step(grad, self._lr())
        s.metrics.apply_seconds.observe(elapsed)
        self._counters["apply_seconds"] += elapsed
        self._counters["steps"] += 1
        s.checkpoints.step_made(s.version, s.capture)
        self._changed()

    def _lr(self) -> float:
        """The schedule's rate for the step about to be taken at the shard's version: derived from the version
        alone, so a restored shard resumes the schedule and every trainer sees the same rate."""
        s = self.shard
        job = s.job
        lr = lr_at(job.lr_schedule, job.optimizer.lr, s.version)
        return lr * lr_factor(job.lr_scaling, self._enrolment.members_at(s.version), job.num_trainers)

    def view(self) -> modes.RoundView:
        """What the mode decisions read of the open round and its members (psserver.state.modes)."""
        s = self.shard
        return self._enrolment.round_view(s.version, s.round, s.pushes.last_base)
