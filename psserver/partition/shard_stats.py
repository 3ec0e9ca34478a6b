"""What a shard tells of itself: counters, its mode and wire dtype, the stats snapshot (GetStats, metrics) and
the state digest that tests compare across refusals.

A room of ``Shard`` (psserver.partition.shard mixes it in), its own because these are reads, most without the lock (see
psserver.partition.shard's docstring): nothing here changes the shard's state.
"""

from __future__ import annotations

import hashlib

import torch

from psserver.protocol.rows.table import hash_tensor

from psserver.protocol.job import WIRE_DTYPES
from psserver.protocol.schedules import lr_at
from psserver.state import modes
from psserver.state.stats import StatsSnapshot


class ShardStats:
    """Counters, the job's mode and wire dtype, the stats snapshot and the state digest."""

    def count(self, name: str, n: float = 1) -> None:
        self.counters[name] += n  # one dict update: atomic under the GIL

    def mode_config(self) -> modes.ModeConfig | None:
        return self._cfg

    def mode(self) -> str:
        job = self.job
        return job.mode if job else ""

    def wire_dtype(self) -> int:
        job = self.job
        return WIRE_DTYPES[job.wire_dtype] if job else 0

    def slice_length(self) -> int:
        return self.end - self.start

    def snapshot(self) -> StatsSnapshot:
        """Stats without the lock (see the module docstring): a scrape or GetStats never waits on a step."""
        job, tables = self.job, self.tables
        return StatsSnapshot(
            shard=self.shard_id, initialized=self.params is not None, version=self.version,
            mode=job.mode if job else "", start=self.start, end=self.end,
            live_ranks=sorted(self.members.view().live), counters={**self.counters, **tables.counters()}, job=job,
            lr=lr_at(job.lr_schedule, job.optimizer.lr, self.version) if job else 0.0, tables=tables.stats(),
        )

    def state_digest(self) -> str:
        """Hash of parameters, optimizer state, version, round buffers and membership epochs with pending joins
        (tests assert refusals leave it unchanged)."""
        with self._lock:
            r = self.round
            h = hashlib.sha256(f"v={self.version};acc_w={r.weight};c={sorted(r.contributors)}".encode())
            if self.params is not None:
                hash_tensor(h, self.params)
                if r.weight:
                    hash_tensor(h, r.sum)
                for k, t in self.optimizer.state_items():
                    h.update(k.encode())
                    if torch.is_tensor(t):
                        hash_tensor(h, t)
                    else:
                        h.update(repr(t).encode())
            h.update(self.tables.digest())
            # who rounds wait for is state too: a refused join must not change it
            h.update(self.enrolment.digest_text().encode())
            h.update(self.cursor.digest_text().encode())
            return h.hexdigest()
