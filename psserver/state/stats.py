"""What a shard reports about itself: ``StatsSnapshot``, a copy of its numbers taken without its lock.

Read by GetStats (psserver.serving.service), the Prometheus collector and the TensorBoard scalars (psserver.state.metrics),
and made by the shard (psserver.partition.shard) and the partitions' host (psserver.partition.host).  A module of its own so the
arrows run one way: shard -> metrics -> stats.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from psserver.protocol.job import JobSpec


@dataclass(frozen=True)
class StatsSnapshot:
    """What GetStats and the metrics exporter read: a copy, taken without the shard's lock."""

    shard: int
    initialized: bool
    version: int
    mode: str
    start: int
    end: int
    live_ranks: list
    counters: dict
    job: JobSpec | None
    lr: float = 0.0  # the rate the next optimizer step uses (0.0 before a job)
    tables: dict = None  # sparse tables: name -> their counters (psserver.sparse.serving.STAT_KEYS)


class WideCounts:
    """What one ps-server process counts whatever layout serves the call -- refusals, bytes in and out, calls,
    cancellations -- in one place that every layout's host shares (psserver.partition.host.ShardHost.successor) and adds to
    its partitions' counts in its snapshot: GetStats and the metrics read the newest layout's host, and a count
    made before a live re-shard's switch is still there after it.  The process's own, like a Prometheus counter:
    not checkpointed, from 0 at a restart (a partition's job counts are checkpointed with its state)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        # ``counts[name] += n`` is a read then a write (and a key's first count runs Counter.__missing__, Python):
        # not atomic under the GIL, and a count may come from a thread other than the loop (snapshot: any thread).
        self._lock = threading.Lock()

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.counts)  # a copy: another thread may count meanwhile
