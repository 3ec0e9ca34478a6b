"""One reply message per Step (issue 21), A/B inside one run: the click model (batch 512, dim 16, Adagrad rows),
2 local shards, 1 trainer, prefetch on, one Step a shard a step; blocks of BLOCK steps take turns among three ways
of reading the reply -- "stream" (one_reply off: a message a part, today's), "packed" (one_reply on, read as a
one-message stream) and "unary" (one_reply on, read with a unary call) -- so a loaded machine's drift falls on all
three alike.  Per block: the trainer's CPU (this process), both shards' CPU and the wall time, ms a step; one JSON
line a block, then one of medians.

    PYTHONPATH=$PWD python docs/bench/onecall/onereply_ab.py MODE [BLOCKS_EACH [BLOCK]]   # MODE: sync | async
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

from psserver.protocol.rows.optim import SparseOptimizerConfig
from trainer.stepping.api import connect
from trainer.local.procs import start_shard
from trainer.workloads.recdata import make_click_log
from trainer.workloads.recmodels import ClickModel, sharded_factories
from trainer.tools.procstat import sample

WAYS = {"stream": (False, False), "packed": (True, False), "unary": (True, True)}  # (one_reply, unary)


def _cpu(pids) -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, sum(sample(p)["cpu"] for p in pids)


def main(mode: str, blocks: int, block: int) -> None:
    torch.set_num_threads(1)
    steps = 20 + blocks * len(WAYS) * block
    log = make_click_log(steps * 512, seed=0).compact()
    run_dir = Path(tempfile.mkdtemp())
    procs = [start_shard(i, run_dir / f"shard{i}.log", extra_args=["--torch-threads", "1"]) for i in range(2)]
    out: dict[str, list] = {w: [] for w in WAYS}
    try:
        model = ClickModel(log.id_space, 16, embedding_bag=sharded_factories(
            SparseOptimizerConfig("adagrad", lr=0.05))["embedding_bag"])
        loss_fn = torch.nn.BCEWithLogitsLoss()
        with connect([p.address for p in procs], model, optimizer={"name": "sgd", "lr": 0.05},
                     embedding_mode="async" if mode == "async" else "") as ps:
            batches = iter(ps.prefetching((log.take(torch.arange(i * 512, (i + 1) * 512)) for i in range(steps)),
                                          ids_of=lambda b: {"bag": b.ids}))

            def run(n: int) -> None:
                for _ in range(n):
                    b = next(batches)
                    loss_fn(model(b.ids, b.offsets, b.weights), b.labels).backward()
                    ps.step(len(b.labels))
                    ps.zero_grad()

            run(20)  # warm-up
            pids = [p.popen.pid for p in procs]
            for k in range(blocks * len(WAYS)):
                way = list(WAYS)[(k + k // len(WAYS)) % len(WAYS)]  # the order rotates every round
                ps.step_call.one_reply, ps.step_call.unary = WAYS[way]
                (t0, s0), w0 = _cpu(pids), time.perf_counter()
                run(block)
                (t1, s1) = _cpu(pids)
                line = {"way": way, "trainer_ms": 1000 * (t1 - t0) / block, "shards_ms": 1000 * (s1 - s0) / block,
                        "wall_ms": 1000 * (time.perf_counter() - w0) / block, "load_average": os.getloadavg()[0]}
                out[way].append(line)
                print(json.dumps({"mode": mode, **{k: round(v, 3) if isinstance(v, float) else v
                                                   for k, v in line.items()}}))
            counters = {k: v for k, v in ps.client.counters.items() if k.startswith("step")}
    finally:
        for p in procs:
            p.terminate()
    print(json.dumps({"mode": mode, "block": block, "counters": counters, "medians": {
        w: {m: round(statistics.median(x[m] for x in v), 3) for m in ("trainer_ms", "shards_ms", "wall_ms")}
        for w, v in out.items()}}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6, int(sys.argv[3]) if len(sys.argv) > 3 else 50)
