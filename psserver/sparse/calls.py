"""The shard side of the row calls (PullRows, PushRows, PushPullRows) that the servicer used to run itself:
checking a call's ids once, waiting for a table's version, and choosing where a call's table work runs.

Made by the servicer (psserver.serving.service) at construction with the shard whose tables it serves, the runtime
(waiters, the state worker) and the call limits; the servicer decodes, calls these, encodes and maps errors.
"""

from __future__ import annotations

import asyncio
import functools

import torch

from psserver.common.logsafe import shorten
from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest, ShuttingDown, TooLarge, WaitTimeout
from psserver.protocol.rows import idpack
from psserver.sparse.pull_refs import PullRefs
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
        self.refs = PullRefs()  # pulls a push may name instead of resending their ids (ids once)

    # -- ids once (issue 21 item 4): packed ids, remembered pulls, pushes that name them --------------------
    @staticmethod
    def pull_ids(raw: bytes, packed: bytes, field: str = "ids") -> torch.Tensor:
        """A pull's ids, sent raw (int64 LE) or packed (psserver.protocol.rows.idpack), bounded before a copy."""
        if raw and packed:
            raise InvalidRequest(f"{field} ({len(raw)} bytes) and packed_{field} ({len(packed)} bytes) are both "
                                 "set: send one")
        if packed:
            if len(packed) > limits.MAX_IDS_PER_CALL * idpack.MAX_VARINT_BYTES:
                raise TooLarge(f"packed_{field} holds {len(packed)} bytes, over the limit of "
                               f"{limits.MAX_IDS_PER_CALL * idpack.MAX_VARINT_BYTES}")
            try:
                return idpack.unpack(packed, limits.MAX_IDS_PER_CALL)
            except idpack.PackError as e:
                raise InvalidRequest(f"packed_{field}: {e}") from None
        return decode_ids(raw)

    def remember(self, h, checked: CheckedIds) -> int:
        """Keep a pull's checked ids for ``h``'s caller and table; the reference its reply names."""
        ref = self.refs.keep((h.fingerprint, h.rank, h.trainer_id, h.table), checked.ids, checked.table)
        self._publish()
        return ref

    def push_ids(self, h) -> torch.Tensor | None:
        """A push's ids named by ``h.pull_refs`` (and ``h.extra_ids``), ascending; None when it names no pull
        (its chunks carry the ids).  Refused: a reference not held (UnknownPullRef), a count not ``num_ids``."""
        if not h.pull_refs:
            if h.extra_ids:
                raise InvalidRequest(f"extra_ids holds {len(h.extra_ids)} bytes but pull_refs is empty: send the "
                                     "ids in the chunks")
            return None
        extra = self.pull_ids(b"", h.extra_ids, "extra_ids") if h.extra_ids else torch.empty(0, dtype=torch.int64)
        try:
            return self.refs.resolve((h.fingerprint, h.rank, h.trainer_id, h.table), list(h.pull_refs), extra,
                                     h.num_ids)
        finally:
            self._publish()

    def push_checked(self, h, table, ids: torch.Tensor) -> CheckedIds | None:
        """A push's ``ids`` marked checked when they are the ids of the one pull its header names, as ``table``
        itself checked them at that pull (range, repeats, placement): the push skips a second check, whose
        placement hash was most of the shard's cost of a named push.  None: check them (several pulls named,
        extra ids, the pull expired since, or another table -- a new job's -- checked it)."""
        if len(h.pull_refs) != 1 or h.extra_ids:
            return None
        if self.refs.checked_by(h.pull_refs[0], ids) is not table:
            return None
        self.refs.counts["trusted"] += 1
        self._publish()
        return CheckedIds(ids, table)

    def _publish(self) -> None:
        """The remembered pulls' numbers into the shard's counters (GetStats, metrics): a gauge of the bytes
        held beside the counts."""
        c, r = self.shard.counters, self.refs
        c["memory_pull_refs_bytes"], c["pull_refs_held"] = r.held_bytes, r.held
        for k, v in r.counts.items():
            c[f"pull_refs_{k}"] = v

    async def check_ids(self, table, ids: torch.Tensor) -> CheckedIds:
        """A call's ids checked once, before anything waits or changes (unique + placement of many ids: off the
        loop); the table's later steps trust the returned ``CheckedIds`` instead of checking again."""
        if table.small_work(len(ids) * table.spec.dim, INLINE_ROW_ELEMENTS):
            return table.check_ids(ids)
        return await self.runtime.offload(table.check_ids, ids)

    async def wait_table(self, name: str, min_version: int, deadline: float) -> float:
        """Wait (an awaited future, no thread) until table ``name`` reaches ``min_version``, at most until
        ``deadline`` (loop time) less a margin; returns the seconds waited."""
        waiters = self.runtime.table_waiters((self.shard, name), functools.partial(self._table_ready, name))
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
        return self._where(self.runtime.inline() and table.small_work(elements, INLINE_ROW_ELEMENTS), fn, *args)

    def run_all(self, sized: list, fn, *args) -> asyncio.Future:
        """``fn`` doing the work of several tables (``sized``: (table, row values) pairs) in one trip: on the
        loop, as ``run`` would run each, only if every one of them is small there; without tables, where the
        dense slice's work runs (``Runtime.run_state``)."""
        if not sized:
            return self.runtime.run_state(fn, *args)
        return self._where(self.runtime.inline() and all(t.small_work(n, INLINE_ROW_ELEMENTS) for t, n in sized),
                           fn, *args)

    def _where(self, small: bool, fn, *args) -> asyncio.Future:
        """``fn`` on the loop (``run_state``, the dense slice small) if ``small``, else on the state worker;
        counted (``row_work_inline``, ``row_work_offloaded``): where a shard's table work runs shows in its stats."""
        self.shard.count("row_work_inline" if small else "row_work_offloaded")
        return self.runtime.run_state(fn, *args) if small else self.runtime.offload(fn, *args)

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


def decode_ids(raw: bytes) -> torch.Tensor:
    """int64 ids from little-endian bytes, bounded before they are copied."""
    if len(raw) % 8:
        raise InvalidRequest(f"ids holds {len(raw)} bytes, not a multiple of 8 (int64 ids)")
    if len(raw) // 8 > limits.MAX_IDS_PER_CALL:
        raise TooLarge(f"ids has {len(raw) // 8} entries, over the limit of {limits.MAX_IDS_PER_CALL}")
    return torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)
