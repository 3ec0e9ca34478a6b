"""A shard's row calls: the member and joiner checks in front of its sparse tables (psserver.sparse.serving).

A room of ``Shard`` (psserver.partition.shard mixes it in), its own because the tables decide their pushes themselves (their
own versions and rounds); the shard only checks who calls, under its lock, and wakes waiting pulls.
"""

from __future__ import annotations

import torch

from psserver.sparse.serving import RowsPush, RowsResult


class ShardRows:
    """PullRows and PushRows on partition 0's tables, behind the member and joiner checks."""

    def check_row_pull(self, rank: int, min_version: int) -> None:
        """Refuse a PullRows from a joiner not yet committed (psserver.members.enrolment); safe on the event loop."""
        self.enrolment.check_row_pull(self.job, rank, min_version)

    def pull_rows(self, rank: int, trainer_id: str, fingerprint: str, table: str,
                  ids: torch.Tensor, min_version: int = 0) -> tuple[int, torch.Tensor]:
        """(table version, rows of the unique ``ids``) for a member; rows met for the first time are created."""
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            self.enrolment.check_row_pull(self.job, rank, min_version)
            result = self.tables.get(table).lookup(ids)
            self.counters["row_pulls"] += 1
            return result

    def check_row_push_lands(self, table: str, push: RowsPush) -> None:
        """Refuse now what ``push_rows`` would refuse of this push once its turn came (a Step's table part, before
        its dense part is pushed: psserver.serving.step_trip).  A read."""
        with self._lock:
            served = self.tables.get(table)
            self.enrolment.check_table_base(self.job, push.rank, push.base, served.mode)
            served.check_lands(push)

    def push_rows(self, fingerprint: str, table: str, push: RowsPush, refuse_nonfinite: bool,
                  checked=None) -> RowsResult:
        """Hand one row push to its table (which checks, deduplicates and decides); wakes waiting pulls.
        ``checked``: the push's ids as the table checked them already (a Step's part: CheckedIds)."""
        with self._lock:
            self.check_member(push.rank, push.trainer_id, fingerprint)
            served = self.tables.get(table)
            self.enrolment.check_table_base(self.job, push.rank, push.base, served.mode)
            result = served.push(push, self.enrolment.table_members(), self._clock(), refuse_nonfinite, checked)
            self.counters["row_pushes"] += 1
            self._changed()
            return result
