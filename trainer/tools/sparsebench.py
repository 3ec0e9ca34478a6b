"""Sparse-table measurements for `ps-bench --sections sparse,rows` (issues 12, 21): memory against live rows,
lookups+updates per second against one process with ``nn.EmbeddingBag(sparse=True)``, and the shard's own time
per 2,048-row pull and push (``row_work``).  The sparse grid of issue 21 is trainer.tools.sparsegrid.

``shard_table_memory`` streams Zipf-distributed ids over 10^9 possible ids through one
table of a ps-server process (pull, then an optimizer step on the same rows, as a training step does)
and samples, every few batches, the live rows, what the table says it holds
and the process's resident memory.  With ``max_rows`` the
table must stop growing once the cap is reached: the samples after that show it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from psserver.protocol.rows.optim import SparseOptimizerConfig, state_width
from trainer.workloads.recdata import zipf_ranks
from trainer.tools.procstat import memory

ID_SPACE = 10**9
_SCRAMBLE = 2654435761  # spreads the Zipf ranks over the id space, as trainer.workloads.recdata's click log does


def zipf_batches(n_batches: int, batch: int, a: float, seed: int):
    """Unique ids of each batch of ``batch`` Zipf(a) draws over ID_SPACE."""
    rng = np.random.default_rng(seed)
    for _ in range(n_batches):
        ranks = zipf_ranks(batch, a, ID_SPACE, rng)
        yield torch.unique(torch.from_numpy(((ranks - 1) * _SCRAMBLE) % ID_SPACE))


def payload_bytes(rows: int, dim: int, optimizer: SparseOptimizerConfig) -> int:
    """rows x dim x 4 x (1 + optimizer state): the issue's yardstick for a table's memory."""
    return rows * (dim + state_width(optimizer, dim)) * 4


def _after_cap(capped: list[dict]) -> dict:
    """Whether the table's own bytes stayed flat once the cap was reached, and how much the process's
    resident memory still moved (allocator fragmentation shows there, not in the table's count)."""
    if len(capped) < 2:
        return {"table_flat_after_cap": False, "rss_change_after_cap": None}
    first, last = capped[0]["rss_growth_bytes"], capped[-1]["rss_growth_bytes"]
    return {"table_flat_after_cap": _flat(capped, "table_bytes"),
            "rss_change_after_cap": (last - first) / max(first, 1)}


def _flat(samples: list[dict], key: str, tolerance: float = 0.01) -> bool:
    """At least two samples, all within ``tolerance`` of the first (the free list and the
    allocator move a table's bytes a little; growth would move them by a doubling)."""
    if len(samples) < 2:
        return False
    first = samples[0][key]
    return all(abs(s[key] - first) <= tolerance * max(first, 1) for s in samples)


# ------------------------------------------------------------------------------------- throughput
def _batches(log, steps: int, batch: int):
    for i in range(steps):
        yield log.take(torch.arange(i * batch, (i + 1) * batch))


def _train(model, log, steps: int, batch: int, step_fn, wrap=lambda batches: batches) -> tuple[float, int, int]:
    """Seconds for ``steps`` click-model steps (forward, BCE, backward, ``step_fn``); ids and unique ids seen.
    ``wrap``: what the batches go through (ps.prefetching)."""
    loss_fn = torch.nn.BCEWithLogitsLoss()
    seen = unique = 0
    t0 = time.perf_counter()
    for b in wrap(_batches(log, steps, batch)):
        loss = loss_fn(model(b.ids, b.offsets, b.weights), b.labels)
        loss.backward()
        step_fn(len(b.labels))
        seen, unique = seen + len(b.ids), unique + len(torch.unique(b.ids))
    return time.perf_counter() - t0, seen, unique


def one_process_step(model, lr: float):
    """The one-process baseline's step: torch's sparse Adagrad on the embedding bags, SGD on the dense layers."""
    from trainer.workloads.recmodels import split_parameters
    sparse, dense = split_parameters(model)
    opts = [torch.optim.Adagrad(sparse, lr=lr), torch.optim.SGD(dense, lr=lr)]

    def step(_n):
        for o in opts:
            o.step()
            o.zero_grad()
    return step


def single_process_rate(log, steps: int, batch: int, dim: int, lr: float) -> dict:
    """One process: ``nn.EmbeddingBag(sparse=True)`` with torch's sparse Adagrad, dense head by SGD."""
    from trainer.workloads.recmodels import ClickModel
    torch.manual_seed(0)
    model = ClickModel(log.id_space, dim)
    seconds, seen, unique = _train(model, log, steps, batch, one_process_step(model, lr))
    return {"seconds": seconds, "ids_per_s": seen / seconds, "unique_ids_per_s": unique / seconds}


def sharded_rate(log, steps: int, batch: int, dim: int, lr: float, shards: int, run_dir, embedding_mode: str = "",
                 prefetch: bool = False, fused: bool = True, cache_rows: int = 0, cache_staleness: int = 0,
                 one_call: bool = True, push_window: int = 1) -> dict:
    """The same model with its bag on ``shards`` ps-server processes (row-wise exchange, Adagrad on
    the shards), one trainer in this process; bytes per step from the row client's counters.
    ``embedding_mode="async"``: async rows next to the sync dense head; ``prefetch``: each batch's rows pulled
    one batch ahead (``ps.prefetching``); ``fused=False``: with prefetch, a sync table's push and its next batch's
    pull stay two calls and the tables go before the dense exchange (the behaviour before PushPullRows);
    ``cache_rows``/``cache_staleness``: the bag's worker-side row cache (trainer.tables.row_cache; 0 rows: none);
    ``one_call=False``: with prefetch, a shard's dense exchange and table push stay two calls side by side (the
    step before the Step RPC, trainer.stepping.step_call);
    ``push_window``: async tables' pushes in flight (trainer.tables.table_window; 1: each waited for)."""
    from psserver.protocol.rows.optim import SparseOptimizerConfig
    from trainer.stepping.api import connect
    from trainer.local.procs import start_shard
    from trainer.workloads.recmodels import ClickModel, sharded_factories
    procs = [start_shard(i, run_dir / f"shard{i}.log", extra_args=["--torch-threads", "1"]) for i in range(shards)]
    try:
        model = ClickModel(log.id_space, dim, embedding_bag=sharded_factories(
            SparseOptimizerConfig("adagrad", lr=lr), cache_rows=cache_rows,
            cache_staleness=cache_staleness)["embedding_bag"])
        with connect([p.address for p in procs], model, optimizer={"name": "sgd", "lr": lr},
                     embedding_mode=embedding_mode, push_window=push_window) as ps:
            wrap = (lambda bs: ps.prefetching(bs, ids_of=lambda b: {"bag": b.ids})) if prefetch else (lambda bs: bs)
            ps.step_call.enabled = one_call
            if not fused:
                ps.rows.fuse = False
                ps.prefetch = _announce_only(ps)
            trips = ps.client.counters["round_trips"]
            seconds, seen, unique = _train(model, log, steps, batch, lambda n: (ps.step(n), ps.zero_grad()), wrap)
            trips = ps.client.counters["round_trips"] - trips
            rows = dict(ps.rows.counters) if getattr(ps, "rows", None) is not None else {}
            shard_rss = [memory(p.popen.pid)["VmRSS"] for p in procs]
    finally:
        for p in procs:
            p.terminate()
    nbytes = rows.get("bytes_pulled", 0) + rows.get("bytes_pushed", 0)
    return {"seconds": seconds, "ids_per_s": seen / seconds, "unique_ids_per_s": unique / seconds,
            "bytes_per_step": nbytes / steps, "row_bytes_per_step": unique * dim * 4 * 2 / steps,
            "shard_rss_bytes": shard_rss, "round_trips_per_step": trips / steps,
            "prefetch_hit_rate": rows.get("prefetch_hits", 0) / max(1, rows.get("prefetch_hits", 0)
                                                                     + rows.get("prefetch_misses", 0)),
            "cache_hit_rate": rows.get("cache_hits", 0) / max(1, sum(rows.get(f"cache_{k}", 0)
                                                                     for k in ("hits", "misses", "stale"))),
            "cache_counts": {k: v for k, v in rows.items() if k.startswith("cache_")},
            "pushes_naming_pulls": rows.get("pushes_naming_pulls", 0), "pull_refs_refused": rows.get("pull_refs_refused", 0),
            "rows_pushed": rows.get("rows_pushed", 0)}


def _announce_only(ps):
    """``ps.prefetch`` without putting the tables beside the dense exchange (the step before PushPullRows)."""
    def prefetch(ids: dict, ahead: int = 1) -> None:
        for name, table_ids in ids.items():
            ps.rows.prefetch(name, table_ids, ahead)
    return prefetch


# ----------------------------------------------------------------------------- shard memory, for real
def shard_table_memory(run_dir, max_rows: int = 1_000_000, dim: int = 32, batches: int = 300,
                       batch: int = 16384, a: float = 1.05, samples: int = 10, seed: int = 0) -> dict:
    """The Zipf stream through a ps-server process (one trainer here, sync, Adagrad
    on the shard): the shard's RSS growth and its table's own accounting, sampled along the stream."""
    from psserver.protocol.rows.init import Initializer
    from trainer.stepping.api import connect
    from trainer.tables.embedding import ShardedEmbedding
    from trainer.local.procs import start_shard
    torch.set_num_threads(1)
    opt = SparseOptimizerConfig("adagrad", lr=0.01)
    model = torch.nn.Module()
    model.table = ShardedEmbedding("zipf", dim, optimizer=opt, initializer=Initializer("uniform", 0.01),
                                   max_rows=max_rows)
    proc = start_shard(0, Path(run_dir) / "shard0.log", extra_args=["--torch-threads", "1"])
    rows, every = [], max(1, batches // samples)
    try:
        with connect([proc.address], model, optimizer={"name": "sgd", "lr": 0.01}) as ps:
            base_rss = memory(proc.popen.pid)["VmRSS"]
            for i, ids in enumerate(zipf_batches(batches, batch, a, seed)):
                model.table(ids).sum().backward()
                ps.step(len(ids))
                ps.zero_grad()
                if (i + 1) % every == 0 or i + 1 == batches:
                    c = ps.shard_stats()[0].counters
                    rows.append({"batch": i + 1, "live_rows": int(c["table.zipf.live_rows"]),
                                 "evicted": int(c["table.zipf.evicted_lru"]),
                                 "table_bytes": int(c["table.zipf.memory_bytes"]),
                                 "payload_bytes": payload_bytes(max_rows, dim, opt),
                                 "rss_growth_bytes": memory(proc.popen.pid)["VmRSS"] - base_rss})
    finally:
        proc.terminate()
    capped = [r for r in rows if r["live_rows"] >= max_rows * 0.9]
    return {"max_rows": max_rows, "dim": dim, "optimizer": "adagrad", "zipf_a": a, "batch": batch,
            "samples": rows, "rss_growth_over_payload": rows[-1]["rss_growth_bytes"] / rows[-1]["payload_bytes"],
            "table_over_payload": rows[-1]["table_bytes"] / rows[-1]["payload_bytes"],
            **_after_cap(capped)}


# ------------------------------------------------------------------- the shard's row work, per call
def row_work(calls: int = 200) -> list[dict]:
    """The shard's own time per 2,048-row pull and push: docs/bench/engine/rowbench.py (a source checkout's),
    run as a process of its own on the checkout's psserver (the shard's table code is not the trainer's to
    import; see docs/architecture.md)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, str(root / "docs/bench/engine/rowbench.py"), "--calls", str(calls)],
                          capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout)
