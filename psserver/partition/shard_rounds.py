"""A shard's rounds: the tick that expires leases and closes a round that is due, closing a round into one
optimizer step, and the rate of that step.

A room of ``Shard`` (psserver.partition.shard mixes it in), its own because when a round closes is decided by
psserver.state.modes over a ``RoundView`` and carried out here alone: the step, the live re-shard's round listener,
the counters and the line for a round closed without everyone, and the checkpoint a step makes due.
"""

from __future__ import annotations

import logging

import torch

from psserver.common.logsafe import counted
from psserver.members.enrolment import MAX_MISSING_LISTED
from psserver.protocol.epochs import lr_factor
from psserver.protocol.schedules import lr_at
from psserver.state import modes

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class ShardRounds:
    """Ticks, closing a round, one optimizer step at the schedule's rate."""

    def tick(self) -> float | None:
        """Expire silent trainers' leases and close a round that is due; returns the next deadline (clock time)."""
        with self._lock:
            if self.job is None:
                return None
            gone = self.enrolment.expire(self.version)
            if self.params is not None:
                self._close_if_due()
            if self.tables.close_due(self.enrolment.table_members(), self._clock()) or gone:
                self._changed()
            deadlines = [*self.enrolment.deadlines(), *self.tables.deadlines(self.enrolment.table_members())]
            if self.params is not None:
                deadlines.append(modes.round_deadline(self._cfg, self._view()))
            deadlines = [d for d in deadlines if d is not None]
            return min(deadlines) if deadlines else None

    def _close_if_due(self) -> None:
        reason = modes.decide_tick(self._cfg, self._view(), self._clock()) if self._cfg else None
        if reason is not None:
            self.close_round(reason)

    def close_round(self, reason: modes.CloseReason) -> None:
        """Average the open round (weighted by samples) and take one optimizer step -- or, when every
        gradient in it was skipped, advance the version without one, so its waiters go on."""
        n = len(self.round.contributors)
        missing = (sorted(self._view().live - self.round.contributors)
                   if reason is not modes.CloseReason.ALL_ARRIVED else [])
        average = self.round.average() if modes.round_takes_step(self.round.weight) else None
        # Reset before the step: a checkpoint the step takes must not hold this round as still open (a
        # --restore would apply it a second time).
        self.round.reset()
        lr = self._lr() if average is not None and self.round_listener is not None else None
        if average is not None:
            self.apply_step(average)
        else:
            self.slice.advance()
            self.counters["rounds_without_step"] += 1
        if self.round_listener is not None:  # after the step: a range copied again is at the new version
            self.round_listener(self, self.version - 1, average, lr)
        self.counters[f"rounds_{reason.value}"] += 1
        if reason is not modes.CloseReason.ALL_ARRIVED:
            log.info("shard %d: round %d closed by %s with %s; missing ranks %s",
                     self.shard_id, self.version - 1, reason.value, counted(n, "gradient"),
                     missing[:MAX_MISSING_LISTED])
        self._changed()

    def apply_push_step(self, grad: torch.Tensor) -> None:
        """An async push's own step.  During a live re-shard each one is a forward (its gradient and lr, as a sync
        round's average is), so the destination replays it (docs/live-reshard.md stage 8)."""
        lr = self._lr() if self.round_listener is not None else None
        self.apply_step(grad)
        if self.round_listener is not None:  # after the step, as close_round's (the log clones the range)
            self.round_listener(self, self.version - 1, grad, lr)

    def apply_step(self, grad: torch.Tensor) -> None:
        """One optimizer step at the schedule's rate (psserver.state.dense_slice), then a checkpoint if one is due."""
        elapsed = self.slice.step(grad, self._lr())
        self.metrics.apply_seconds.observe(elapsed)
        self.counters["apply_seconds"] += elapsed
        self.counters["steps"] += 1
        self.checkpoints.step_made(self.version, self.capture)  # held during a push until its books are written
        self._changed()

    def _lr(self) -> float:
        """The schedule's rate for the step about to be taken at ``self.version``: derived from the version
        alone, so a restored shard resumes the schedule and every trainer sees the same rate."""
        lr = lr_at(self.job.lr_schedule, self.job.optimizer.lr, self.version)
        return lr * lr_factor(self.job.lr_scaling, self.enrolment.members_at(self.version), self.job.num_trainers)

    def _view(self) -> modes.RoundView:
        return self.enrolment.round_view(self.version, self.round, self.pushes.last_base)
