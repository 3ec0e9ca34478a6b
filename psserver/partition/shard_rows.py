"""A shard's row calls: the member and joiner checks in front of its sparse tables (psserver.sparse.serving).

``RowCalls`` is a room of ``Shard`` (psserver.partition.shard makes it), its own because the tables decide their pushes
themselves (their own versions and rounds); the shard only checks who calls, under its lock, and wakes waiting
pulls.  The tables and the job are the shard's, read at each call (a new job replaces them).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from psserver.sparse.serving import RowsPush, RowsResult


class RowCalls:
    """PullRows and PushRows on partition 0's tables, behind the member and joiner checks."""

    def __init__(self, shard, lock: threading.RLock, clock: Callable[[], float], changed: Callable[[], None],
                 admission):
        """``shard``: the psserver.partition.shard.Shard whose tables these are (not imported: it imports this);
        ``admission``: its psserver.partition.shard_members.Admission (who may call)."""
        self.shard = shard
        self._lock, self._clock, self._changed, self._admission = lock, clock, changed, admission
        self._enrolment, self._counters = shard.enrolment, shard.counters

    def check_row_pull(self, rank: int, min_version: int) -> None:
        """Refuse a PullRows from a joiner not yet committed (psserver.members.enrolment); safe on the event loop."""
        self._enrolment.checks.check_row_pull(self.shard.job, rank, min_version)

    def pull_rows(self, rank: int, trainer_id: str, fingerprint: str, table: str,
                  ids: torch.Tensor, min_version: int = 0) -> tuple[int, torch.Tensor]:
        """(table version, rows of the unique ``ids``) for a member; rows met for the first time are created."""
        s = self.shard
        with self._lock:
            self._admission.check_member(rank, trainer_id, fingerprint)
            self._enrolment.checks.check_row_pull(s.job, rank, min_version)
            result = s.tables.get(table).lookup(ids)
            self._counters["row_pulls"] += 1
            return result

    def check_row_push_lands(self, table: str, push: RowsPush) -> None:
        """Refuse now what ``push_rows`` would refuse of this push once its turn came (a Step's table part, before
        its dense part is pushed: psserver.serving.step_trip).  A read."""
        s = self.shard
        with self._lock:
            served = s.tables.get(table)
            self._enrolment.checks.check_table_base(s.job, push.rank, push.base, served.mode)
            served.check_lands(push)

    def push_rows(self, fingerprint: str, table: str, push: RowsPush, refuse_nonfinite: bool,
                  checked=None) -> RowsResult:
        """Hand one row push to its table (which checks, deduplicates and decides); wakes waiting pulls.
        ``checked``: the push's ids as the table checked them already (a Step's part: CheckedIds)."""
        s = self.shard
        with self._lock:
            self._admission.check_member(push.rank, push.trainer_id, fingerprint)
            served = s.tables.get(table)
            self._enrolment.checks.check_table_base(s.job, push.rank, push.base, served.mode)
            result = served.push(push, self._enrolment.table_members(), self._clock(), refuse_nonfinite, checked)
            self._counters["row_pushes"] += 1
            self._changed()
            return result
