"""The shard's own time per pull and push of a few thousand rows (issue 21): ``ps-bench --sections rows`` runs
this script as a process and reads its JSON (the trainer's tools do not import the shard's code).

    PYTHONPATH=$PWD python docs/bench/engine/rowbench.py --calls 200

One table (dim 16, Adagrad) served by ``ServedTable`` -- lookup, lazy creation, the optimizer update and the
gather, what PullRows and PushRows run under the shard's lock, without gRPC framing -- fed unique Zipf ids
over 10^9 (the click log's law: trainer.workloads.recdata).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.sparse.serving import Membership, RowsPush, ServedTable

ID_SPACE = 10**9
_SCRAMBLE = 2654435761  # spreads the ranks over the id space (odd, not a multiple of 5: a permutation)


def _zipf_ranks(n: int, a: float, rng: np.random.Generator) -> np.ndarray:
    """n ranks in 1..ID_SPACE, bounded Zipf(a) by inverse CDF (trainer.workloads.recdata.zipf_ranks's law)."""
    top = float(ID_SPACE + 1) ** (1.0 - a)
    x = (1.0 - rng.random(n) * (1.0 - top)) ** (1.0 / (1.0 - a))
    return np.minimum(np.floor(x).astype(np.int64), ID_SPACE)


def row_work(rows: int = 2048, calls: int = 200, warmup: int = 30, optimizer: str = "adagrad", dim: int = 16,
             a: float = 1.05, seed: int = 0, ids: str = "new") -> list[dict]:
    """Milliseconds of one shard's table (psserver.sparse.serving.ServedTable, what PullRows and PushRows run
    under the shard's lock; gRPC framing not included) per pull and per push of ``rows`` unique Zipf ids over
    10^9, one torch thread: sync (one trainer: each push closes its round and applies it) and async with a
    per-row staleness bound whose pushes lag 3 versions behind (so every push checks each row's last update).
    Medians over ``calls`` after ``warmup``, of wall time and of this thread's CPU time (steadier on a loaded
    machine); ``ids="new"``: the stream keeps meeting new ids, so each pull creates rows too; ``"existing"``: the
    calls cycle over the first 4 batches, so after the warm-up every id has its row (lookup and update alone)."""
    torch.set_num_threads(1)
    out = []
    for label, mode, bound, lag in (("sync", "", None, 0), ("async, max_staleness 2", "async", 2, 3)):
        spec = TableSpec("rows", dim, optimizer=SparseOptimizerConfig(optimizer, lr=0.01), mode=mode,
                         max_staleness=bound)
        job = JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=1, fingerprint="0" * 16,
                      tensors=(("w", (1,), "float32"),), tables=(spec,))
        table, members = ServedTable(spec, job), Membership(frozenset({0}))
        grads = torch.full((rows, dim), 1e-3)
        times, created = [], 0  # (pull wall, pull cpu, push wall, push cpu) per call, in seconds
        for i, batch in enumerate(_batches(ids, warmup + calls, rows, a, seed)):
            before = table.store.counts.rows_created
            t0, c0 = time.perf_counter(), time.thread_time()
            version, _ = table.lookup(batch)
            t1, c1 = time.perf_counter(), time.thread_time()
            table.push(RowsPush(0, "bench", max(0, version - lag), 1, i + 1, batch, grads), members, 0.0)
            t2, c2 = time.perf_counter(), time.thread_time()
            if i >= warmup:
                times.append((t1 - t0, c1 - c0, t2 - t1, c2 - c1))
                created += table.store.counts.rows_created - before
        med = 1000 * np.median(np.array(times), axis=0)
        out.append({"mode": label, "optimizer": optimizer, "ids": ids, "rows": rows, "pull_ms": float(med[0]),
                    "pull_cpu_ms": float(med[1]), "push_ms": float(med[2]), "push_cpu_ms": float(med[3]),
                    "new_rows_per_pull": created / calls, "live_rows": len(table.store)})
    return out


def _batches(ids: str, n: int, rows: int, a: float, seed: int):
    """``n`` batches: fresh Zipf batches (``new``) or the first 4 of them over and over (``existing``)."""
    if ids == "new":
        yield from _unique_batches(n, rows, a, seed)
        return
    first = list(_unique_batches(4, rows, a, seed))
    for i in range(n):
        yield first[i % 4]


def _unique_batches(n: int, rows: int, a: float, seed: int):
    """``n`` sorted batches of ``rows`` unique Zipf(a) ids over ID_SPACE (drawn until that many are distinct)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        draws = 3 * rows
        while True:
            ranks = _zipf_ranks(draws, a, rng)
            ids = np.unique(((ranks - 1) * _SCRAMBLE) % ID_SPACE)
            if len(ids) >= rows:
                break
            draws *= 2
        yield torch.from_numpy(np.sort(rng.permutation(ids)[:rows]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python docs/bench/engine/rowbench.py", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="measured pulls and pushes per mode")
    p.add_argument("--rows", type=int, default=2048, help="unique ids per call")
    p.add_argument("--optimizer", default="adagrad", choices=("sgd", "adagrad", "rowwise_adagrad", "adam"))
    p.add_argument("--ids", default="new", choices=("new", "existing"),
                   help="new: each pull meets new ids (lazy creation); existing: ids whose rows are stored")
    args = p.parse_args(argv)
    if args.calls < 1 or args.rows < 1:
        print(f"error: --calls ({args.calls}) and --rows ({args.rows}) must be at least 1", file=sys.stderr)
        return 2
    print(json.dumps(row_work(rows=args.rows, calls=args.calls, optimizer=args.optimizer, ids=args.ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
