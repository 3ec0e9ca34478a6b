"""The step engine on and off (``ps-server --no-step-engine``), interleaved: CPU milliseconds a step of the trainer
(this process) and of each shard, and the wall time a step, for the click model (batch 512, dim 16, Adagrad rows,
2 local shards, 1 trainer, prefetch on, StepOnce); MODE "sync" (full sync) or "async" (sync dense, async
embeddings).  Each pair of runs (off, then on) starts its own shards; one JSON line a run, then the medians.

    PYTHONPATH=$PWD python docs/bench/engine/cpu_ab.py MODE [PAIRS [STEPS]]
"""
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import trainer.local.procs as procs
from trainer.workloads.recdata import make_click_log
from trainer.tools import sparsebench
from trainer.tools.procstat import sample

torch.set_num_threads(1)
state = {"pids": [], "cpu": {}, "extra": []}
start_shard, train = procs.start_shard, sparsebench._train


def _start(shard, log_path, *a, extra_args=None, **k):
    p = start_shard(shard, log_path, *a, extra_args=(extra_args or []) + state["extra"], **k)
    state["pids"].append(p.popen.pid)
    return p


def _timed(*a, **k):
    pids = state["pids"]
    s0, r0, t0 = [sample(p)["cpu"] for p in pids], resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = train(*a, **k)
    s1, r1 = [sample(p)["cpu"] for p in pids], resource.getrusage(resource.RUSAGE_SELF)
    state["cpu"].update(shards_ms=[round(1000 * (b - a) / steps, 3) for a, b in zip(s0, s1)],
                        trainer_ms=round(1000 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps, 3),
                        wall_ms=round(1000 * (time.perf_counter() - t0) / steps, 3))
    return out


procs.start_shard, sparsebench._train = _start, _timed
mode = sys.argv[1]
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
log = make_click_log(steps * 512, seed=0).compact()
runs = {"off": [], "on": []}
for _ in range(pairs):
    for way in ("off", "on"):
        state.update(pids=[], cpu={}, extra=["--no-step-engine"] if way == "off" else [])
        sparsebench.sharded_rate(log, steps, 512, 16, 0.05, 2, Path(tempfile.mkdtemp()),
                                 embedding_mode="async" if mode == "async" else "", prefetch=True, one_call=True)
        line = {"engine": way, "mode": mode, **state["cpu"], "load_average": round(os.getloadavg()[0], 2)}
        runs[way].append(line)
        print(json.dumps(line), flush=True)
print(json.dumps({"mode": mode, "steps": steps, "medians": {
    way: {"shard_ms": round(statistics.median(sum(r["shards_ms"]) / 2 for r in rs), 3),
          "trainer_ms": round(statistics.median(r["trainer_ms"] for r in rs), 3),
          "wall_ms": round(statistics.median(r["wall_ms"] for r in rs), 3)} for way, rs in runs.items()}}))
