"""What a shard reports about itself: ``StatsSnapshot``, a copy of its numbers taken without its lock.

Read by GetStats (psserver.service), the Prometheus collector and the TensorBoard scalars (psserver.metrics),
and made by the shard (psserver.shard) and the partitions' host (psserver.host).  A module of its own so the
arrows run one way: shard -> metrics -> stats.
"""

from __future__ import annotations

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
