"""The retry discipline of a shard's calls: which codes are retried, the backoff within a budget, and which
refusals mean the shard restarted.

A room of ``ShardClient`` (trainer.channels.client mixes ``RetriedCalls`` in), its own because every call -- dense, control,
and the tables' (trainer.tables.sparse_client) -- goes through the one ``_call`` and the one reading of a restart, and a
change to either should be read in one place.  ``RetriedCalls`` uses the client's ``address``, ``name``,
``retry``, ``counters`` and their lock.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc

from psserver.protocol.rules import refused_layout_ahead, refused_layout_moved

log = logging.getLogger("trainer.channels.client")  # the client's lines, as before the split (trainer.running.cli sets its level)
T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# A push is also retried after DEADLINE_EXCEEDED: its reply may have been lost, and the sequence number
# makes the retry a DUPLICATE rather than a second application.
PUSH_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# A shard answering these restarted: it no longer knows the trainer, came back empty, or is behind it.
# The trainer registers again (dense slice: trainer.stepping.api; tables: trainer.tables.sparse_client).
RESTART_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION)


def restarted(error: grpc.RpcError) -> bool:
    """Whether ``error`` says the shard restarted (register again).  The reason trailer is read first: a
    ``layout-moved`` refusal (FAILED_PRECONDITION) means the job switched layouts -- the call changed nothing and
    goes again in the new layout (trainer.membership.relayout) -- and ``layout-ahead`` (OUT_OF_RANGE) is retried within the
    retry budget (ShardClient._call); neither is a restart (docs/live-reshard.md)."""
    if error.code() not in RESTART_CODES:
        return False
    return refused_layout_moved(error) is None and not refused_layout_ahead(error)


@dataclass(frozen=True)
class RetryPolicy:
    budget_seconds: float = 60.0  # keep retrying one call this long (a restarting shard needs seconds)
    initial_backoff: float = 0.05
    max_backoff: float = 2.0


class RetriedCalls:
    """Every call's retries and what a reply or refusal tells of the layout; the counters' one lock."""

    def saw_epoch(self, header) -> None:
        """Weights received: the membership epoch their shard names for their round (``header.version``)."""
        self.epoch_seen, self.epoch_round = header.membership_epoch, header.version

    def saw_layout(self, number: int) -> int:
        """A reply (or a layout-moved refusal) named layout ``number``: the newest seen is kept."""
        self.layout_seen = max(self.layout_seen, number)
        return number

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _call(self, what: str, fn: Callable[[], T], retry_on: tuple = RETRYABLE) -> T:
        """Run ``fn``, retrying ``retry_on`` codes with exponential backoff and full jitter within the budget."""
        delay = self.retry.initial_backoff
        give_up = time.monotonic() + self.retry.budget_seconds
        attempt = 0
        while True:
            attempt += 1
            self._count("round_trips")  # every data call's attempt (heartbeats aside): what a step costs in calls
            try:
                return fn()
            except grpc.RpcError as e:
                self.saw_layout(refused_layout_moved(e) or 0)  # a refused push teaches the newest layout too
                ahead = refused_layout_ahead(e)  # a shard restarted from an older layout record: it catches up
                if (e.code() not in retry_on and not ahead) or time.monotonic() >= give_up:
                    raise
                self._count("retries")
                if ahead:
                    self._count("layout_ahead_retries")
                pause = random.uniform(0, delay)
                log.warning("%s to %s (%s) failed with %s (%s); retry %d in %.2f s", what, self.name,
                            self.address, e.code().name, e.details(), attempt, pause)
                time.sleep(pause)  # backoff between attempts, not synchronisation
                delay = min(delay * 2, self.retry.max_backoff)
