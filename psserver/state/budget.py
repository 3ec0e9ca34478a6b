"""The shard's memory budget (``ps-server --max-memory``): what a job may hold, decided at Register.

A job spec is a client's say-so; without a bound, one Register could ask a shard for any amount of
memory (a dim-65,536 Adam table, a 2**36-parameter slice) and a failed allocation half-way would
leave the shard half-made.  So the first Register of a job is *planned* here before anything of it
is made (``plan``): the dense slice of every partition with its optimizer state and round sum, each
table with an explicit ``max_rows`` at that many rows, and each table without one gets an even share
of what is left -- its ``row_limit``, the rows it may hold before a call that would add rows is
refused (RESOURCE_EXHAUSTED, ``psserver.protocol.rows.errors.TableFull``).  A plan that does not fit
is refused naming the field, the bytes it needs and the budget; nothing is made.

The estimate is of what the job itself holds; not counted: the receive buffers (bounded on their own
by ``--receive-buffers``), replies in flight, and the interpreter.  Hence a default well under the
machine's memory (``default_max_memory``).  See docs/memory.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from psserver.protocol.errors import OutOfMemory
from psserver.protocol.job import JobSpec
from psserver.protocol.layout import partition_range
from psserver.protocol.rows.table import row_bytes, scratch_bytes, start_bytes

# The default budget is this fraction of the memory the machine (or the shard's cgroup) has available
# when the shard starts: the rest is for what the plan does not count (above) and for neighbours.
DEFAULT_FRACTION = 0.5
FALLBACK_BYTES = 4 << 30  # where neither /proc/meminfo nor a cgroup limit can be read
MIN_TABLE_ROWS = 1  # a table without max_rows whose share holds fewer rows is refused at Register


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def available_memory() -> int | None:
    """Bytes this process could still get: the smaller of MemAvailable and the cgroup's room (v2 or v1)."""
    found = []
    meminfo = _read("/proc/meminfo") or ""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    if m:
        found.append(int(m.group(1)) * 1024)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = (_read(limit_file) or "").strip(), (_read(usage_file) or "0").strip()
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or v1's huge number: no limit
            found.append(max(0, int(limit) - (int(usage) if usage.isdigit() else 0)))
    return min(found) if found else None


def default_max_memory() -> int:
    """``--max-memory``'s default: DEFAULT_FRACTION of ``available_memory()`` at start-up (FALLBACK_BYTES when
    it cannot be read)."""
    room = available_memory()
    return max(1 << 20, int(room * DEFAULT_FRACTION)) if room else FALLBACK_BYTES


# Bytes of the machine a table's growth leaves free (psserver.protocol.rows.table.RowStore's ``room``): shards each
# budget a share of what was free at their own start, so several on one host may together promise more than it
# has; a growth past what is free now is refused rather than left to the kernel's OOM killer.
MACHINE_FLOOR = 256 << 20


def check_machine_room(nbytes: int, what: str, available=None) -> None:
    """Refuse (OutOfMemory, RESOURCE_EXHAUSTED) ``what``'s ``nbytes`` more when the machine (or this process's
    cgroup) has less than that available now beyond MACHINE_FLOOR; nothing to refuse where it cannot be read.
    ``available``: the probe (default ``available_memory``; tests pass their own)."""
    room = (available or available_memory)()
    if room is not None and nbytes > room - MACHINE_FLOOR:
        raise OutOfMemory(f"{what} needs {nbytes} bytes more but this machine has {room} bytes available now "
                          f"({MACHINE_FLOOR} kept free): its shards' budgets promised more than it has -- give each "
                          "ps-server a --max-memory that fits beside the others, or give its tables max_rows")


def optimizer_copies(job: JobSpec) -> int:
    """Slice-sized tensors of optimizer state: Adam's two moments, SGD's momentum buffer."""
    name = job.optimizer.name
    return 2 if name in ("adam", "adamw") else (1 if job.optimizer.momentum else 0)


def dense_bytes(job: JobSpec, shard: int) -> int:
    """What the job's dense slice costs this shard over all its partitions: the parameters, the optimizer
    state, the round's sum (sync and stale-timeout) and one pull snapshot (a step that runs while pulls stream
    moves the parameters aside)."""
    copies = 1 + optimizer_copies(job) + (0 if job.mode == "async" else 1) + 1
    elements = sum(end - start for start, end in
                   (partition_range(job.total_params, job.num_shards, job.partitions, shard, k)
                    for k in range(job.partitions)))
    return elements * 4 * copies


@dataclass(frozen=True)
class Plan:
    """What a job may hold on this shard: ``needs`` (field -> bytes reserved) and each unbounded table's
    ``row_limits`` (name -> rows)."""

    limit: int
    needs: dict = field(default_factory=dict)
    row_limits: dict = field(default_factory=dict)
    tables_bytes: int = 0  # the tables' part of ``needs``: what their accounting is held to

    @property
    def total(self) -> int:
        return sum(self.needs.values())


class MemoryBudget:
    """``limit`` bytes for one shard process; ``plan`` fits a job in them or refuses it."""

    def __init__(self, limit: int | None = None):
        self.limit = default_max_memory() if limit is None else int(limit)
        if self.limit < 1:
            raise ValueError(f"--max-memory ({self.limit} bytes) must be at least 1 byte")

    def plan(self, job: JobSpec, shard: int, strict: bool = True) -> Plan:
        """Fit ``job`` in the budget: dense slice first, then the tables with max_rows, then an even share of
        the rest for each table without.  ``strict=False`` (a restored job, already made) never refuses.

        Raises:
            OutOfMemory: RESOURCE_EXHAUSTED naming the field that did not fit, its bytes and the budget.
        """
        needs: dict[str, int] = {}
        left = self.limit
        fixed = [("total_params", dense_bytes(job, shard), self._dense_why(job, shard))]
        fixed += [(f"tables[{t.name}].max_rows",
                   t.max_rows * row_bytes(t) + start_bytes(t) + scratch_bytes(t, t.max_rows),
                   f"{t.max_rows} rows of {row_bytes(t)} bytes (dim {t.dim}, optimizer {t.optimizer.name}) and "
                   f"{scratch_bytes(t, t.max_rows)} of update scratch")
                  for t in job.tables if t.max_rows is not None]
        fixed += [(f"tables[{t.name}]", start_bytes(t), "its index and admission sketch")
                  for t in job.tables if t.max_rows is None]
        for name, nbytes, why in fixed:
            if strict and nbytes > left:
                self._refuse(name, nbytes, why, left)
            needs[name] = nbytes
            left -= nbytes
        return self._share(job, needs, max(0, left), strict)

    def _share(self, job: JobSpec, needs: dict, left: int, strict: bool) -> Plan:
        """Give each table without max_rows an even share of ``left`` bytes, as a row limit."""
        open_tables = [t for t in job.tables if t.max_rows is None]
        row_limits = {}
        for t in open_tables:
            share = left // len(open_tables)
            rows = _rows_in(t, share)
            if strict and rows < MIN_TABLE_ROWS:
                self._refuse(f"tables[{t.name}]", MIN_TABLE_ROWS * row_bytes(t) + scratch_bytes(t, MIN_TABLE_ROWS),
                             f"at least {MIN_TABLE_ROWS} row of dim {t.dim} with optimizer {t.optimizer.name} "
                             f"and its update scratch "
                             f"(an even share of what the rest of the job left among {len(open_tables)} "
                             "table(s) without max_rows)", share)
            row_limits[t.name] = max(MIN_TABLE_ROWS, rows)
            needs[f"tables[{t.name}]"] += row_limits[t.name] * row_bytes(t) + scratch_bytes(t, row_limits[t.name])
        tables_bytes = sum(v for k, v in needs.items() if k.startswith("tables["))
        return Plan(self.limit, needs, row_limits, tables_bytes)

    @staticmethod
    def _dense_why(job: JobSpec, shard: int) -> str:
        return (f"the dense slice of {job.partitions} partition(s) of {job.total_params} parameters over "
                f"{job.num_shards} shard(s), with optimizer {job.optimizer.name}'s state")

    def _refuse(self, name: str, nbytes: int, why: str, left: int) -> None:
        raise OutOfMemory(f"{name} needs {nbytes} bytes ({why}) but the shard's memory budget is {self.limit} bytes "
                          f"with {left} left for it: raise ps-server --max-memory or make the job smaller")


def _rows_in(t, share: int) -> int:
    """The most rows of table ``t`` that fit in ``share`` bytes with the update scratch they keep."""
    lo, hi = 0, share // row_bytes(t)  # the cost grows with the rows: the largest that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * row_bytes(t) + scratch_bytes(t, mid) <= share:
            lo = mid
        else:
            hi = mid - 1
    return lo


def handoff_bytes(job: JobSpec, job2: JobSpec, moves: list, old_index: int | None, new_index: int | None,
                  max_lag: int) -> dict[str, int]:
    """What a live re-shard adds on this shard beside the job it holds (docs/design/handoff-io.md), by part: each move
    out copied with its optimizer state and its forward log at its bound (``max_lag`` rounds of the range), and
    the new pieces this shard will serve (psserver.resharding.handoff.shard_ops's PREPARE checks it against the budget)."""
    out = [m for m in moves if m.src == old_index]
    copies = 1 + optimizer_copies(job)
    return {"copies": sum(m.b - m.a for m in out) * 4 * copies,
            "forward logs": sum(m.b - m.a for m in out) * 4 * max_lag,
            "new pieces": dense_bytes(job2, new_index) if new_index is not None else 0}
