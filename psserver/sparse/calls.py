"""The shard side of the row calls (PullRows, PushRows, PushPullRows) that the servicer used to run itself:
checking a call's ids once, waiting for a table's version, and choosing where a call's table work runs.

Made by the servicer (psserver.service) at construction with the shard whose tables it serves, the runtime
(waiters, the state worker) and the call limits; the servicer decodes, calls these, encodes and maps errors.
"""

from __future__ import annotations

import asyncio
import functools

import torch

from psserver.common.logsafe import shorten
from psserver.protocol.errors import ShuttingDown, WaitTimeout
from psserver.sparse.serving import CheckedIds

# Row calls up to this many row elements (ids x dim: 4,096 ids of dim 16) run on the loop when the dense slice's
# work does: a row call's table work is ~0.3-1 us per id, so the loop is held a few ms at most, and the hop to the
# state worker and back cost ~0.1-0.3 ms of a ~1.5 ms PullRows of 1,300 ids (measured on 2 loaded cores).
INLINE_ROW_ELEMENTS = 1 << 16


class RowCalls:
    """Row-call steps of ``shard``'s tables (partition 0's), on ``runtime``; ``max_pull_wait``: seconds at most
    a pull waits for a version."""

    def __init__(self, shard, runtime, max_pull_wait: float):
        self.shard, self.runtime, self.max_pull_wait = shard, runtime, max_pull_wait

    async def check_ids(self, table, ids: torch.Tensor) -> CheckedIds:
        """A call's ids checked once, before anything waits or changes (unique + placement of many ids: off the
        loop); the table's later steps trust the returned ``CheckedIds`` instead of checking again."""
        if table.small_work(len(ids) * table.spec.dim, INLINE_ROW_ELEMENTS):
            return table.check_ids(ids)
        return await self.runtime.offload(table.check_ids, ids)

    async def wait_table(self, name: str, min_version: int, deadline: float) -> float:
        """Wait (an awaited future, no thread) until table ``name`` reaches ``min_version``, at most until
        ``deadline`` (loop time) less a margin; returns the seconds waited."""
        waiters = self.runtime.table_waiters(name, functools.partial(self._table_ready, name))
        loop = asyncio.get_running_loop()
        timeout = min(max(0.0, deadline - loop.time() - 0.25), self.max_pull_wait)
        t0 = loop.time()
        if not await waiters.wait(min_version, timeout):
            table = self.shard.tables.by_name.get(name)
            raise WaitTimeout(f"table {shorten(name)} on shard {self.shard.shard_id} is at version "
                              f"{table.version if table else 'none'}; min_version {min_version} was not reached "
                              f"within {timeout:.1f} s")
        if self.runtime.stopping:
            raise ShuttingDown(f"shard {self.shard.shard_id} is shutting down")
        return loop.time() - t0

    async def wait_push_base(self, table, name: str, rank: int, base: int, deadline: float):
        """A push one round ahead of the table that ``ServedTable.push_waits`` allows waits (as a pull would) for
        the open round to close, then goes on -- refusing it as from the future told its trainer the shard had
        restarted (a spurious restart, with prefetch); any other push goes on at once.  Returns the table."""
        if base <= table.version or not table.push_waits(rank, base, self.shard.enrolment.joins_at(rank, base)):
            return table
        self.shard.count("row_pushes_waited")
        await self.wait_table(name, base, deadline)
        return self.shard.tables.get(name)  # a new job may have replaced the tables meanwhile

    def _table_ready(self, name: str, min_version: int) -> bool:
        """Wait predicate: the table reached ``min_version`` -- or is gone (a new job) or the shard stops, when
        the waiting pull ends and says why."""
        table = self.shard.tables.by_name.get(name)
        return self.runtime.stopping or table is None or table.ready(min_version)

    def run(self, table, elements: int, fn, *args) -> asyncio.Future:
        """``fn`` on the state worker -- or on the loop where the dense slice's work runs there too and all the
        work the call can do (its rows, the table, the open round: ``ServedTable.small_work``) is at most
        INLINE_ROW_ELEMENTS values."""
        if self.runtime.inline() and table.small_work(elements, INLINE_ROW_ELEMENTS):
            return self.runtime.run_state(fn, *args)
        return self.runtime.offload(fn, *args)

    async def pull(self, table, name: str, rank: int, trainer_id: str, fingerprint: str, min_version: int,
                   ids: CheckedIds, deadline: float, hold) -> tuple[float, object, int, torch.Tensor]:
        """A pull's second half, once its ids are checked: refuse a version this shard will not reach, wait for
        it, ``hold(bytes)`` the reply's memory, gather.  Returns (seconds waited, the table, version, rows)."""
        # a restarted shard would never answer; a joiner waits for the round before its first
        table.check_wait(rank, min_version, min_version > table.version
                         and self.shard.enrolment.joins_at(rank, min_version))
        waited = await self.wait_table(name, min_version, deadline)
        table = self.shard.tables.get(name)  # a new job may have replaced the tables meanwhile
        n = len(ids.ids)
        hold(n * table.spec.dim * 4)  # before the rows are gathered
        version, rows = await self.run(table, n * table.spec.dim, self.shard.pull_rows, rank, trainer_id,
                                       fingerprint, name, ids, min_version)
        return waited, table, version, rows
