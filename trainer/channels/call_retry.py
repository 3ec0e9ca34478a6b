"""The retry discipline of a shard's calls: which codes are retried, the backoff within a budget, and which
refusals mean the shard restarted; and who the calls are from and to (``Caller``).

``RetriedCalls`` is a collaborator of ``ShardClient`` (trainer.channels.client), its own because every call -- dense,
control, and the tables' (trainer.tables.row_calls) and the Step's (trainer.stepping.step_call) -- goes through the one
``call`` and the one reading of a restart, and a change to either should be read in one place.  It owns what it
uses: the ``Caller`` its log lines name, the ``RetryPolicy``, the shared counters and their lock, and the newest
layout and membership epoch its calls' replies named.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
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
    retry budget (RetriedCalls.call); neither is a restart (docs/live-reshard.md)."""
    if error.code() not in RESTART_CODES:
        return False
    return refused_layout_moved(error) is None and not refused_layout_ahead(error)


@dataclass(frozen=True)
class RetryPolicy:
    budget_seconds: float = 60.0  # keep retrying one call this long (a restarting shard needs seconds)
    initial_backoff: float = 0.05
    max_backoff: float = 2.0


@dataclass
class Caller:
    """Who one shard partition's calls are from and to, the one copy its client and the client's collaborators
    share: the shard's ``address`` and ``index``, the ``partition``, the ``name`` messages give it, the trainer
    (``rank``, ``trainer_id``), the job's ``fingerprint`` and the ``layout_epoch`` the calls name.  Only ``rank``
    changes, once, when a join is given its rank (trainer.membership.registration.Registration.set_rank); a layout
    switch makes new clients (trainer.membership.relayout)."""

    address: str
    index: int
    partition: int
    name: str
    rank: int
    trainer_id: str
    fingerprint: str
    layout_epoch: int = 0


class RetriedCalls:
    """Every call's retries and what a reply or refusal tells of the layout and the membership epoch.

    ``counters`` and ``lock``: the ones every shard's client shares (trainer.channels.client.ShardedClient).
    ``layout_seen``: the newest layout any reply or layout-moved refusal named (docs/live-reshard.md;
    trainer.membership.relayout follows it); ``epoch_seen``: the membership epoch of the newest weights received
    (docs/elastic.md), ``epoch_round``: those weights' version, the round the epoch is named for."""

    def __init__(self, caller: Caller, retry: RetryPolicy, counters: Counter, lock: threading.Lock):
        self.caller, self.retry, self.counters, self.lock = caller, retry, counters, lock
        self.layout_seen = caller.layout_epoch
        self.epoch_seen = 0
        self.epoch_round = -1

    def saw_epoch(self, header) -> None:
        """Weights received: the membership epoch their shard names for their round (``header.version``)."""
        self.epoch_seen, self.epoch_round = header.membership_epoch, header.version

    def saw_layout(self, number: int) -> int:
        """A reply (or a layout-moved refusal) named layout ``number``: the newest seen is kept."""
        self.layout_seen = max(self.layout_seen, number)
        return number

    def count(self, name: str, n: int = 1) -> None:
        """Add to a shared counter from any thread."""
        with self.lock:
            self.counters[name] += n

    def call(self, what: str, fn: Callable[[], T], retry_on: tuple = RETRYABLE) -> T:
        """Run ``fn``, retrying ``retry_on`` codes with exponential backoff and full jitter within the budget."""
        delay = self.retry.initial_backoff
        give_up = time.monotonic() + self.retry.budget_seconds
        attempt = 0
        while True:
            attempt += 1
            self.count("round_trips")  # every data call's attempt (heartbeats aside): what a step costs in calls
            try:
                return fn()
            except grpc.RpcError as e:
                self.saw_layout(refused_layout_moved(e) or 0)  # a refused push teaches the newest layout too
                ahead = refused_layout_ahead(e)  # a shard restarted from an older layout record: it catches up
                if (e.code() not in retry_on and not ahead) or time.monotonic() >= give_up:
                    raise
                self.count("retries")
                if ahead:
                    self.count("layout_ahead_retries")
                pause = random.uniform(0, delay)
                log.warning("%s to %s (%s) failed with %s (%s); retry %d in %.2f s", what, self.caller.name,
                            self.caller.address, e.code().name, e.details(), attempt, pause)
                time.sleep(pause)  # backoff between attempts, not synchronisation
                delay = min(delay * 2, self.retry.max_backoff)
