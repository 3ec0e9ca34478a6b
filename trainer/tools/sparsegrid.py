"""The sparse grid of issue 21 (`ps-bench --sections sparse-grid`): click and Criteo-shaped models through psgrpc
as a user runs them, each row against its own one-process run and against the transport floor.

Why it is shaped so: a ratio to one process means something only if both halves ran at the same moment and the
distributed half ran the way a user would.  So every psgrpc row (trainer.tools.gridplan says which) is paired
with a one-process run right before it on the same batches -- its shards already up and idle, so nothing but the
two runs shares the cores between them -- and its trainers loop over ``ps.prefetching`` (each batch's ids found
through the model's sharded modules, one batch ahead; the Step call then makes one StepOnce a shard a step).  The
1-minute load average is kept with each row: a row measured under load is not a verdict.  A row with one trainer
also gets its transport floor (trainer.tools.stepfloor): its own Step sizes, replayed over bare gRPC.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from pathlib import Path

import torch

from trainer.tools import gridplan, stepfloor
from trainer.tools.gridplan import GridRow

logger = logging.getLogger("trainer.tools.sparsegrid")
GRID_LR, GRID_DIM = 0.05, 16


@functools.lru_cache(maxsize=2)
def _grid_data(workload: str, samples: int, compact: bool):
    """The workload's samples: the click log (bags of 1..8 Zipf ids over 10^9) or the Criteo-shaped log."""
    from trainer.workloads.recdata import make_click_log, make_criteo_synth
    log = make_click_log(samples, seed=0) if workload == "click" else make_criteo_synth(samples, seed=0)
    return log.compact() if compact else log


def _grid_batches(workload: str, log, count: int, batch: int, rank: int = 0, trainers: int = 1):
    """Rank r's batches: global batches r, r + N, ..."""
    for i in range(count):
        rows = torch.arange((i * trainers + rank) * batch, (i * trainers + rank + 1) * batch)
        yield log.take(rows) if workload == "click" else log[rows]


def _grid_model(workload: str, log, factories: dict | None):
    """The click model (an EmbeddingBag and a small head) or DLRM (26 tables, dot interaction)."""
    from trainer.workloads.recmodels import DLRM, ClickModel
    torch.manual_seed(0)
    if workload == "click":
        kw = {"embedding_bag": factories["embedding_bag"]} if factories else {}
        return ClickModel(log.id_space, GRID_DIM, **kw)
    kw = {"embedding": factories["embedding"]} if factories else {}
    return DLRM(log.cardinalities, dim=GRID_DIM, **kw)


def _grid_forward(workload: str):
    """How the model takes a batch: what the loop calls, and what ``ps.prefetching`` runs to find a batch's ids."""
    if workload == "click":
        return lambda model, b: model(b.ids, b.offsets, b.weights)
    return lambda model, b: model(b.dense, b.ids)


def _grid_ids(workload: str, b) -> tuple[int, int]:
    """(ids looked up, unique ids per table summed): what one step pulls and pushes."""
    if workload == "click":
        return len(b.ids), len(torch.unique(b.ids))
    return b.ids.numel(), sum(len(torch.unique(b.ids[:, t])) for t in range(b.ids.shape[1]))


def _grid_steps(workload: str, model, batches, step_fn) -> dict:
    """Train on ``batches`` (forward, BCE, backward, ``step_fn``); time the steps after the first WARMUP.  Unique
    ids a step: over every step, as the row bytes they are compared with (a step's rows are pulled the step before)."""
    forward, warmup = _grid_forward(workload), gridplan.WARMUP
    seen = unique = timed = 0
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        if i == warmup:
            t0, seen = time.perf_counter(), 0
        loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(model, b), b.labels)
        loss.backward()
        step_fn(len(b.labels))
        n, u = _grid_ids(workload, b)
        seen, unique, timed = seen + n, unique + u, timed + (i >= warmup)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "steps": timed, "steps_per_s": timed / seconds, "ids_per_s": seen / seconds,
            "unique_per_step": unique / (i + 1)}


def grid_one_process(workload: str, batch: int, steps: int) -> dict:
    """One process: ``nn.EmbeddingBag``/``nn.Embedding(sparse=True)`` with torch's sparse Adagrad, the dense layers
    by SGD -- what each sharded row is compared with.  ``steps`` timed, after WARMUP untimed."""
    from trainer.tools.sparsebench import one_process_step
    torch.set_num_threads(1)
    total = steps + gridplan.WARMUP
    log = _grid_data(workload, total * batch, compact=True)
    model = _grid_model(workload, log, None)
    return _grid_steps(workload, model, _grid_batches(workload, log, total, batch),
                       one_process_step(model, GRID_LR))


class StepBytes:
    """Each shard's Step request and reply bytes, step by step (the floor replays them).  The trainer keeps no
    per-shard message sizes, so the bench makes the Step stubs again over the same channels with serializers that
    also count (one ``len`` a message); the calls are the trainer's own otherwise."""

    def __init__(self, ps):
        from psserver.protocol.stepwire import parse_step, serialize_step
        from psserver.protocol.stubs import method
        sc, shards = ps.step_call, ps.client.shards
        self.req, self.rep, self.steps = [0] * len(shards), [0] * len(shards), []

        def counting(i: int):
            def ser(msg) -> bytes:
                b = serialize_step(msg)
                self.req[i] += len(b)
                return b

            def par(b: bytes):
                self.rep[i] += len(b)
                return parse_step(b)
            return ser, par

        for i, s in enumerate(shards):
            ser, par = counting(i)
            sc._once[i] = s.channel.unary_unary(method("StepOnce"), ser, par)
            sc._unary[i] = s.channel.unary_unary(method("Step"), ser, par)
            sc._one[i] = s.channel.unary_stream(method("Step"), ser, par)
            sc._stubs[i] = s.channel.stream_stream(method("Step"), ser, par)

    def mark(self) -> None:
        """End of a step: keep its sizes if every shard had a Step call (not a two-call step)."""
        if all(self.req) and all(self.rep):
            self.steps.append(list(zip(self.req, self.rep)))
        self.req, self.rep = [0] * len(self.req), [0] * len(self.rep)


def _grid_trainer(args: tuple) -> dict:
    """One trainer of a sharded grid run (in this process, or a spawned one for N > 1): the loop a user writes,
    over ``ps.prefetching``; rank 0 also keeps its Step sizes for the floor."""
    row, addresses, rank, job_id = args
    from psserver.protocol.rows.optim import SparseOptimizerConfig
    from trainer.stepping.api import connect
    from trainer.workloads.recmodels import sharded_factories
    torch.set_num_threads(1)
    total = row.steps + gridplan.WARMUP
    log = _grid_data(row.workload, total * row.batch * row.trainers, compact=False)
    model = _grid_model(row.workload, log, sharded_factories(
        SparseOptimizerConfig("adagrad", lr=GRID_LR), cache_rows=row.cache_rows, cache_staleness=row.cache_staleness))
    with connect(addresses, model, rank=rank, num_trainers=row.trainers, optimizer={"name": "sgd", "lr": GRID_LR},
                 embedding_mode=row.embedding_mode, push_window=row.push_window, job_id=job_id) as ps:
        sizes, before = StepBytes(ps) if rank == 0 else None, dict(ps.rows.counters)

        def step(n: int) -> None:
            ps.step(n)
            ps.zero_grad()
            if sizes is not None:
                sizes.mark()
        batches = ps.prefetching(_grid_batches(row.workload, log, total, row.batch, rank, row.trainers),
                                 forward=_grid_forward(row.workload))
        out = _grid_steps(row.workload, model, batches, step)
        ps.flush()  # a push window's last pushes: their bytes are counted when answered
        rows = {k: v - before.get(k, 0) for k, v in ps.rows.counters.items()}
    # over every step, warm-up too: a step's rows are pulled during the step before it (prefetch), so a window of
    # timed steps would count one pull fewer than pushes
    return {**out, **_row_counts(rows, total), "step_sizes": sizes.steps[-row.steps:] if sizes else None}


def _row_counts(rows: dict, steps: int) -> dict:
    """Bytes a step, prefetch and cache hit rates from the row client's counters over the run."""
    def rate(hits: int, total: int) -> float | None:
        return hits / total if total else None
    cache = sum(rows.get(f"cache_{k}", 0) for k in ("hits", "misses", "stale"))
    return {"row_bytes_per_step": (rows.get("bytes_pulled", 0) + rows.get("bytes_pushed", 0)) / steps,
            "prefetch_hit_rate": rate(rows.get("prefetch_hits", 0),
                                      rows.get("prefetch_hits", 0) + rows.get("prefetch_misses", 0)),
            "cache_hit_rate": rate(rows.get("cache_hits", 0), cache)}


def _start_shards(count: int, run_dir: Path) -> list:
    """``count`` ps-server processes (one torch thread each), started together."""
    from trainer.local.procs import await_ready, launch_shard
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i in range(count):
            procs.append(launch_shard(i, run_dir / f"shard{i}.log", extra_args=["--torch-threads", "1"]))
        await_ready(procs, 60.0)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    return procs


def grid_sharded(row: GridRow, run_dir: Path, procs: list | None = None) -> dict:
    """``row``'s model with its tables on ``row.shards`` ps-server processes (``procs`` if already up) and
    ``row.trainers`` trainers (this process for one, spawned processes for more); Adagrad on the shards' rows,
    the dense layers by SGD on the shards."""
    import multiprocessing
    own = procs is None
    procs = _start_shards(row.shards, run_dir) if own else procs
    try:
        addresses, job = [p.address for p in procs], f"grid-{uuid.uuid4().hex[:8]}"
        jobs = [(row, addresses, r, job) for r in range(row.trainers)]
        if row.trainers == 1:
            per = [_grid_trainer(jobs[0])]
        else:
            with multiprocessing.get_context("spawn").Pool(row.trainers) as pool:
                per = pool.map(_grid_trainer, jobs)
    finally:
        if own:
            for p in procs:
                p.terminate()
    unique = sum(p["unique_per_step"] for p in per) / row.trainers
    return {"steps": per[0]["steps"], "steps_per_s": sum(p["steps_per_s"] for p in per) / row.trainers,
            "ids_per_s": sum(p["ids_per_s"] for p in per),
            "row_bytes_per_step": sum(p["row_bytes_per_step"] for p in per) / row.trainers,
            "unique_bytes_per_step": unique * GRID_DIM * 4 * 2, "unique_per_step": unique,
            "prefetch_hit_rate": per[0]["prefetch_hit_rate"], "cache_hit_rate": per[0]["cache_hit_rate"],
            "step_sizes": per[0]["step_sizes"]}


def paired_row(row: GridRow, run_dir: Path) -> dict:
    """``row``'s shards started, then its one-process run, then the sharded run (the pair as close as it gets);
    the 1-minute load average before and after."""
    procs = _start_shards(row.shards, run_dir)
    try:
        load_before = os.getloadavg()[0]
        one = grid_one_process(row.workload, row.batch, row.steps)
        r = grid_sharded(row, run_dir, procs)
        load_after = os.getloadavg()[0]
    finally:
        for p in procs:
            p.terminate()
    return {"workload": row.workload, "batch": row.batch, "system": row.system, "shards": row.shards,
            "trainers": row.trainers, "push_window": row.push_window, "cache_rows": row.cache_rows,
            **r, "ratio": gridplan.ratio(r["ids_per_s"], one["ids_per_s"]), "one_process": one,
            "load_1m": [load_before, load_after]}


def floor_of(r: dict, sizes: list | None, run_dir: Path) -> dict | None:
    """A one-trainer row's transport floor: ``sizes`` (its own Step sizes, or an earlier row's of its cell when its
    steps took the two-call path, as a push window's do: the same batches, the same rows) replayed over bare gRPC,
    plus its one-process run's step time; None for N trainers (one client is not N) or without sizes."""
    if r["trainers"] != 1 or not sizes:
        return None
    one = r["one_process"]
    transport = stepfloor.measure(sizes, run_dir)
    shards = range(len(sizes[0]))
    return {**gridplan.floor_figures(one["seconds"] / one["steps"], transport, one["steps_per_s"]),
            "request_bytes": [sum(step[i][0] for step in sizes) / len(sizes) for i in shards],
            "reply_bytes": [sum(step[i][1] for step in sizes) / len(sizes) for i in shards]}


def sparse_grid(run_dir: Path, cells, quick: bool = False) -> list[dict]:
    """Every row of ``cells`` (gridplan.plan), each paired with its own one-process run and followed by its
    transport floor.  A row whose run fails is kept with the failure's first line (and logged): the grid goes on."""
    out = []
    for rows in gridplan.plan(cells, quick):
        last = None
        for k, row in enumerate(rows):
            try:
                r = paired_row(row, run_dir / f"grid-{row.workload}-{row.batch}-{row.shards}x{row.trainers}-{k}")
            except Exception as e:  # noqa: BLE001 -- reported in the row (and the log), not lost
                logger.warning("sparse grid: %s failed: %s", row, e)
                out.append(failed_row(row, e))
                continue
            last = r.pop("step_sizes") or last
            r["floor"] = floor_of(r, last, run_dir)
            out.append(r)
    return out


def failed_row(row: GridRow, error: BaseException) -> dict:
    """A row that did not run to the end: what it was and the first line of why."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return {"workload": row.workload, "batch": row.batch, "system": row.system, "shards": row.shards,
            "trainers": row.trainers, "push_window": row.push_window, "cache_rows": row.cache_rows,
            "error": f"{type(error).__name__}: {first}", "load_1m": [os.getloadavg()[0]]}
