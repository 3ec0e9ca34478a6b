"""What a shard tells of itself: the stats snapshot (GetStats, metrics) and the state digest that tests compare
across refusals.

``Stats`` is a room of ``Shard`` (psserver.partition.shard makes it), its own because these are reads, the snapshot
without the lock (see psserver.partition.shard's docstring): nothing here changes the shard's state, which is read at
each call.  The one-line reads (counters, the job's mode and wire dtype) are ``Shard``'s own.
"""

from __future__ import annotations

import hashlib
import threading

import torch

from psserver.protocol.rows.table import hash_tensor
from psserver.protocol.schedules import lr_at
from psserver.state.stats import StatsSnapshot


class Stats:
    """The stats snapshot and the state digest of ``shard``."""

    def __init__(self, shard, lock: threading.RLock):
        """``shard``: the psserver.partition.shard.Shard told of (not imported: it imports this)."""
        self.shard = shard
        self._lock = lock

    def snapshot(self) -> StatsSnapshot:
        """Stats without the lock (see the module docstring): a scrape or GetStats never waits on a step."""
        s = self.shard
        job, tables = s.job, s.tables
        return StatsSnapshot(
            shard=s.shard_id, initialized=s.params is not None, version=s.version,
            mode=job.mode if job else "", start=s.start, end=s.end,
            live_ranks=sorted(s.members.view().live), counters={**s.counters, **tables.counters()}, job=job,
            lr=lr_at(job.lr_schedule, job.optimizer.lr, s.version) if job else 0.0, tables=tables.stats(),
        )

    def state_digest(self) -> str:
        """Hash of parameters, optimizer state, version, round buffers and membership epochs with pending joins
        (tests assert refusals leave it unchanged)."""
        s = self.shard
        with self._lock:
            r = s.round
            h = hashlib.sha256(f"v={s.version};acc_w={r.weight};c={sorted(r.contributors)}".encode())
            if s.params is not None:
                hash_tensor(h, s.params)
                if r.weight:
                    hash_tensor(h, r.sum)
                for k, t in s.optimizer.state_items():
                    h.update(k.encode())
                    if torch.is_tensor(t):
                        hash_tensor(h, t)
                    else:
                        h.update(repr(t).encode())
            h.update(s.tables.digest())
            # who rounds wait for is state too: a refused join must not change it
            h.update(s.enrolment.digest_text().encode())
            h.update(s.cursor.digest_text().encode())
            return h.hexdigest()
