"""CPU milliseconds a step of the trainer (this process) and of each shard, with the wall time a step: the click
model (batch 512, dim 16, Adagrad rows), 2 local shards, 1 trainer, prefetch on; MODE "sync" or "async" (sync dense,
async embeddings), ONE_CALL 1 (Step) or 0 (two calls).  On shared cores the CPU a step is steadier than steps/s.

    PYTHONPATH=$PWD python docs/bench/onecall/cpu.py MODE ONE_CALL [STEPS [PUSH_WINDOW]]   # PUSH_WINDOW: 1
"""
import json
import os
import resource
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
pids, cpu = [], {}
start_shard, train = procs.start_shard, sparsebench._train


def _start(*a, **k):
    p = start_shard(*a, **k)
    pids.append(p.popen.pid)
    return p


def _timed(*a, **k):
    s0, r0, t0 = [sample(p)["cpu"] for p in pids], resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = train(*a, **k)
    s1, r1 = [sample(p)["cpu"] for p in pids], resource.getrusage(resource.RUSAGE_SELF)
    cpu.update(shards_ms=[round(1000 * (b - a) / steps, 3) for a, b in zip(s0, s1)],
               trainer_ms=round(1000 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps, 3),
               wall_ms=round(1000 * (time.perf_counter() - t0) / steps, 3))
    return out


procs.start_shard, sparsebench._train = _start, _timed
mode, one_call = sys.argv[1], sys.argv[2] == "1"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
window = int(sys.argv[4]) if len(sys.argv) > 4 else 1
log = make_click_log(steps * 512, seed=0).compact()
r = sparsebench.sharded_rate(log, steps, 512, 16, 0.05, 2, Path(tempfile.mkdtemp()),
                             embedding_mode="async" if mode == "async" else "", prefetch=True, one_call=one_call, push_window=window)
print(json.dumps({"mode": mode, "one_call": one_call, "push_window": window, **cpu, "round_trips_per_step": r["round_trips_per_step"],
                  "load_average": os.getloadavg()[0]}))
