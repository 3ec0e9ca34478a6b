"""Where the trainer's stepping thread spends its CPU (issue 21, trainerlean): the click model (batch 512, dim 16,
Adagrad rows), 2 local shards, 1 trainer, prefetch on, StepOnce; MODE "sync" or "async" (sync dense, async
embeddings).  After WARM steps, STEPS steps run under cProfile with the thread's own CPU clock (time.thread_time):
what the pool threads do (shard 1's call) is not in it.  Prints the thread's CPU a step, then the top functions by
cumulative and by own time (pstats), to stdout; with PROFILE_OUT set, the raw profile is dumped there too (pstats).

    PYTHONPATH=$PWD python docs/bench/onecall/trainer_profile.py MODE [STEPS [WARM [PUSH_WINDOW]]]
"""
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from psserver.protocol.rows.optim import SparseOptimizerConfig
from trainer.stepping.api import connect
from trainer.local.procs import start_shard
from trainer.workloads.recdata import make_click_log
from trainer.workloads.recmodels import ClickModel, sharded_factories


def main(mode: str, steps: int, warm: int, window: int) -> None:
    torch.set_num_threads(1)
    log = make_click_log((steps + warm) * 512, seed=0).compact()
    run_dir = Path(tempfile.mkdtemp())
    procs = [start_shard(i, run_dir / f"shard{i}.log", extra_args=["--torch-threads", "1"]) for i in range(2)]
    try:
        model = ClickModel(log.id_space, 16, embedding_bag=sharded_factories(
            SparseOptimizerConfig("adagrad", lr=0.05))["embedding_bag"])
        loss_fn = torch.nn.BCEWithLogitsLoss()
        with connect([p.address for p in procs], model, optimizer={"name": "sgd", "lr": 0.05},
                     embedding_mode="async" if mode == "async" else "", push_window=window) as ps:
            batches = iter(ps.prefetching((log.take(torch.arange(i * 512, (i + 1) * 512))
                                           for i in range(steps + warm)), ids_of=lambda b: {"bag": b.ids}))

            def run(n: int) -> None:
                for _ in range(n):
                    b = next(batches)
                    loss_fn(model(b.ids, b.offsets, b.weights), b.labels).backward()
                    ps.step(len(b.labels))
                    ps.zero_grad()

            run(warm)
            prof = cProfile.Profile(time.thread_time)
            c0, t0 = time.thread_time(), time.perf_counter()
            prof.runcall(run, steps)
            c1, t1 = time.thread_time(), time.perf_counter()
    finally:
        for p in procs:
            p.terminate()
    print(f"mode {mode} window {window}: stepping thread {1000 * (c1 - c0) / steps:.3f} ms CPU a step under the "
          f"profiler, wall {1000 * (t1 - t0) / steps:.3f} ms a step, load {os.getloadavg()[0]:.2f}")
    if os.environ.get("PROFILE_OUT"):
        prof.dump_stats(os.environ["PROFILE_OUT"])
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
        print(out.getvalue())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400, int(sys.argv[3]) if len(sys.argv) > 3 else 30,
         int(sys.argv[4]) if len(sys.argv) > 4 else 1)
