"""What `ps-bench --sections sparse-grid` runs, and the arithmetic of its rows: pure, no torch, no network.

Why a room of its own: which cells run (``--grid-cells``), which rows a cell has (the ways a user would run the
model: full sync, sync dense + async tables, the same with a push window, with a row cache), how many steps each
takes and how a row's ratio and transport floor are figured are decisions worth testing without starting a shard
(tests/unit/test_gridplan.py); the runs themselves are trainer.tools.sparsegrid's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

WORKLOADS = ("click", "criteo")
# (workload, batch): timed steps -- enough for a steady figure at each size; WARMUP more go first, untimed (connect,
# first allocations, the first step's two calls before prefetch has announced a batch)
TIMED_STEPS = {("click", 512): 200, ("click", 8192): 30, ("criteo", 2048): 30}
WARMUP = 5
QUICK_TIMED = 8
# issue 21's target rows: click 512 (both modes), click 8,192 and criteo 2,048, each on 2 shards x 1 trainer
TARGET_CELLS = (("click", 512, 2, 1), ("click", 8192, 2, 1), ("criteo", 2048, 2, 1))
ALL_CELLS = tuple((w, b, s, t) for w, b in TIMED_STEPS for s in (1, 2) for t in (1, 2))
CACHE_ROWS, CACHE_STALENESS = 100_000, 4  # the click model's row-cache row (docs/row-cache.md)
PUSH_WINDOW = 4


@dataclass(frozen=True)
class GridRow:
    """One psgrpc run of a cell, paired with its own one-process run just before it."""
    workload: str
    batch: int
    shards: int
    trainers: int
    label: str  # "sync", "sync dense, async tables", ...
    embedding_mode: str  # the tables' mode: "" (the job's: sync) or "async"
    steps: int  # timed steps; WARMUP more run first
    push_window: int = 1
    cache_rows: int = 0
    cache_staleness: int = 0

    @property
    def system(self) -> str:
        return f"psgrpc {self.label}"


def timed_steps(workload: str, batch: int) -> int:
    """TIMED_STEPS for the grid's own cells; any other batch: 200 for small click batches, else 30."""
    return TIMED_STEPS.get((workload, batch), 200 if workload == "click" and batch <= 1024 else 30)


def parse_grid_cells(text: str) -> tuple[tuple[str, int, int, int], ...]:
    """``all``, ``targets`` or ``WORKLOAD:BATCH:SHARDSxTRAINERS,...`` (e.g. ``click:512:2x1``) as cells;
    ValueError naming the flag, the value and what it must be."""
    text = text.strip()
    if text == "all":
        return ALL_CELLS
    if text == "targets":
        return TARGET_CELLS
    cells = []
    for item in (x.strip() for x in text.split(",")):
        parts = item.split(":")
        st = parts[2].split("x") if len(parts) == 3 else []
        numbers = [parts[1], *st] if len(st) == 2 else []
        if (len(parts) != 3 or parts[0] not in WORKLOADS or not numbers
                or not all(n.isdigit() and int(n) > 0 for n in numbers)):
            raise ValueError(f"--grid-cells ({text}): {item!r} is not WORKLOAD:BATCH:SHARDSxTRAINERS with WORKLOAD "
                             f"one of {', '.join(WORKLOADS)} (e.g. click:512:2x1); or use 'all' or 'targets'")
        cells.append((parts[0], int(parts[1]), int(st[0]), int(st[1])))
    return tuple(cells)


def cell_rows(workload: str, batch: int, shards: int, trainers: int, steps: int) -> list[GridRow]:
    """A cell's rows, as a user would run the model: full sync; sync dense + async tables; the same with async
    tables' pushes in a window of PUSH_WINDOW; and for the click model the same with a row cache."""
    base = GridRow(workload, batch, shards, trainers, "sync", "", steps)
    rows = [base, replace(base, label="sync dense, async tables", embedding_mode="async"),
            replace(base, label=f"sync dense, async tables, push window {PUSH_WINDOW}", embedding_mode="async",
                    push_window=PUSH_WINDOW)]
    if workload == "click":
        rows.append(replace(base, label=f"sync dense, async tables, row cache ({CACHE_ROWS:,} rows, bound "
                                        f"{CACHE_STALENESS})", embedding_mode="async", cache_rows=CACHE_ROWS,
                            cache_staleness=CACHE_STALENESS))
    return rows


def plan(cells, quick: bool = False) -> list[list[GridRow]]:
    """Each cell's rows, in the order they run (each row's one-process run goes right before it)."""
    return [cell_rows(w, b, s, t, QUICK_TIMED if quick else timed_steps(w, b)) for w, b, s, t in cells]


def ratio(sharded_ids_per_s: float, one_ids_per_s: float) -> float:
    """N trainers' ids/s summed against one process's (for one trainer: the ratio of steps/s)."""
    return sharded_ids_per_s / one_ids_per_s


def floor_figures(one_step_seconds: float, transport_seconds: float, one_steps_per_s: float) -> dict:
    """The floor of a step: the one-process step's compute, then the step's bytes over bare gRPC -- its steps/s
    and ratio to the paired one-process run."""
    rate = 1.0 / (one_step_seconds + transport_seconds)
    return {"steps_per_s": rate, "ratio": rate / one_steps_per_s, "transport_ms": 1000 * transport_seconds}
