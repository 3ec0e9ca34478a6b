"""What the executor (psserver.state.executor) does to a dense slice: the ``PushTarget`` hooks of a ``Shard``.

A room of ``Shard`` (psserver.partition.shard), made by it at construction with the shard itself (the state the hooks act
on, through its public members), its rounds (psserver.partition.shard_rounds: a round closed, a push's own step) and its
``changed`` callback.  The decisions are psserver.state.modes'; the ladder that
carries them out is the executor's; these hooks say what a dense gradient is, how it joins the round, how it is
applied, and how each event is counted and logged.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from psserver.protocol.errors import FutureVersion, InvalidRequest, StaleGradient
from psserver.protocol.rules import Mode
from psserver.state import modes
from psserver.state.executor import PushInfo, PushTarget
from psserver.state.push_book import PushResult

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split
_EVENT_COUNTERS = {"stale_dropped": "stale_dropped", "skipped": "nonfinite_skipped"}


class DenseHooks(PushTarget):
    """The executor's view of ``shard``'s dense slice."""

    def __init__(self, shard, rounds, changed: Callable[[], None]):
        """``shard``: the psserver.partition.shard.Shard these hooks act on, ``rounds`` its
        psserver.partition.shard_rounds.Rounds (neither imported here: the wing above imports this)."""
        self.shard = shard
        self._rounds = rounds
        self._changed = changed

    @property
    def round(self):
        return self.shard.round

    @property
    def version(self) -> int:
        return self.shard.version

    def count_event(self, event: str) -> None:
        self.shard.counters[_EVENT_COUNTERS[event]] += 1

    def future(self, base: int) -> Exception:
        s = self.shard
        return FutureVersion(f"base version is {base} but {s.label} is at version {s.version}")

    def stale(self, base: int, staleness: int) -> Exception:
        s = self.shard
        return StaleGradient(f"stale gradient: base version {base} is {staleness} behind version {s.version} of "
                             f"shard {s.shard_id}; dropped -- pull version {s.version} and go on",
                             s.version, staleness)

    def duplicate(self, push: PushInfo) -> None:
        self.shard.counters["duplicates"] += 1
        log.info("shard %d: duplicate push from rank %d for base %d acknowledged, not applied",
                 self.shard.shard_id, push.rank, push.base)

    def result(self, outcome: str, staleness: int, **extra) -> PushResult:
        return PushResult(outcome, self.shard.version, staleness)

    def skipped(self, push: PushInfo) -> None:
        log.warning("shard %d: skipped a gradient with NaN/Inf values from rank %d (base %d)",
                    self.shard.shard_id, push.rank, push.base)
        if not push.sequenced and self.shard.mode_config().mode == Mode.ASYNC:
            self.shard.pushes.note_base(push.rank, push.base)

    def apply_now(self, push: PushInfo, staleness: int) -> PushResult:
        self._rounds.apply_push_step(push.payload)
        self._count_applied(push)
        self.shard.counters["staleness_sum"] += staleness
        if not push.sequenced:
            self.shard.pushes.note_base(push.rank, push.base)
        return self.result("applied", staleness)

    def accumulate(self, push: PushInfo, weight: float) -> torch.Tensor:
        try:
            spare = self.shard.round.add(push.payload, weight)
        except InvalidRequest:
            self.shard.counters["refused_overflow"] += 1
            raise
        self._count_applied(push)
        return spare

    def _count_applied(self, push: PushInfo) -> None:
        self.shard.counters["pushes_applied"] += 1
        self.shard.counters["samples"] += push.num_samples

    def close_round(self, reason: modes.CloseReason) -> None:
        self._rounds.close_round(reason)

    def scaled_in(self, push: PushInfo, factor: float) -> None:
        self.shard.counters["stale_scaled"] += 1
        log.info("shard %d: scaled a stale gradient from rank %d by %.3f (staleness %d)",
                 self.shard.shard_id, push.rank, factor, self.shard.version - push.base)

    def round_changed(self) -> None:
        self._changed()
