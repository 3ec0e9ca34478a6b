"""The shard's side of the sparse step (issue 21, smallwork), A/B inside one run: the click model (batch 512, dim 16,
Adagrad rows), 2 local shards, 1 trainer, prefetch on, one StepOnce a shard a step -- against shards of two or more
source trees at once.  Each TREE (a checkout, e.g. `git archive REV | tar -x -C DIR`) gets its own 2 ps-server
processes (run from that tree) and its own session and model in this one trainer process (from this tree); blocks
of BLOCK steps take turns between the trees, the order rotated each round, so a loaded machine's drift falls on
all.  Per block: the trainer's CPU (this process), the CPU of that tree's two shards (/proc) and the wall time, ms a
step; one JSON line a block, then one of medians and each tree's shard counters (where its table work ran).

    PYTHONPATH=$PWD python docs/bench/onecall/smallwork_ab.py MODE BLOCKS_EACH BLOCK TREE...
    # MODE: sync | async (sync dense, async embeddings); a TREE's name in the output is its folder's name
"""
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from psserver.protocol.rows.optim import SparseOptimizerConfig
from trainer.stepping.api import connect
from trainer.local.procs import start_shard
from trainer.workloads.recdata import make_click_log
from trainer.workloads.recmodels import ClickModel, sharded_factories
from trainer.tools.procstat import sample


def _trainer_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _shards(tree: Path, run_dir: Path) -> list:
    """Two ps-servers of ``tree``: run from it (``python -c`` puts its working folder first on the path)."""
    return [start_shard(i, run_dir / f"{tree.name}-shard{i}.log", extra_args=["--torch-threads", "1"],
                        env={"PYTHONPATH": str(tree)}, prefix=["env", "-C", str(tree)]) for i in range(2)]


def main(mode: str, blocks: int, block: int, trees: list[Path]) -> None:
    torch.set_num_threads(1)
    steps = 20 + blocks * block
    log = make_click_log(steps * 512, seed=0).compact()
    run_dir = Path(tempfile.mkdtemp())
    names = [t.name for t in trees]
    out: dict[str, list] = {n: [] for n in names}
    procs: dict[str, list] = {}
    counters: dict[str, dict] = {}
    try:
        for t in trees:
            procs[t.name] = _shards(t, run_dir)
        with ExitStack() as stack:
            runs = {}
            for name in names:
                torch.manual_seed(0)
                model = ClickModel(log.id_space, 16, embedding_bag=sharded_factories(
                    SparseOptimizerConfig("adagrad", lr=0.05))["embedding_bag"])
                ps = stack.enter_context(connect([p.address for p in procs[name]], model,
                                                 optimizer={"name": "sgd", "lr": 0.05},
                                                 embedding_mode="async" if mode == "async" else ""))
                batches = iter(ps.prefetching((log.take(torch.arange(i * 512, (i + 1) * 512)) for i in range(steps)),
                                              ids_of=lambda b: {"bag": b.ids}))
                runs[name] = (model, ps, batches)
            loss_fn = torch.nn.BCEWithLogitsLoss()

            def run(name: str, n: int) -> None:
                model, ps, batches = runs[name]
                for _ in range(n):
                    b = next(batches)
                    loss_fn(model(b.ids, b.offsets, b.weights), b.labels).backward()
                    ps.step(len(b.labels))
                    ps.zero_grad()

            for name in names:
                run(name, 20)  # warm-up
            for k in range(blocks * len(names)):
                name = names[(k + k // len(names)) % len(names)]  # the order rotates every round
                pids = [p.popen.pid for p in procs[name]]
                t0, s0, w0 = _trainer_cpu(), sum(sample(p)["cpu"] for p in pids), time.perf_counter()
                run(name, block)
                t1, s1 = _trainer_cpu(), sum(sample(p)["cpu"] for p in pids)
                line = {"tree": name, "trainer_ms": 1000 * (t1 - t0) / block, "shards_ms": 1000 * (s1 - s0) / block,
                        "wall_ms": 1000 * (time.perf_counter() - w0) / block, "load_average": os.getloadavg()[0]}
                out[name].append(line)
                print(json.dumps({"mode": mode, **{k: round(v, 3) if isinstance(v, float) else v
                                                   for k, v in line.items()}}), flush=True)
            for name in names:
                summed = counters[name] = {}
                for r in runs[name][1].shard_stats():  # both shards', summed
                    for k, v in r.counters.items():
                        if k.startswith(("row_work_", "step_calls")):
                            summed[k] = summed.get(k, 0) + v
    finally:
        for ps_procs in procs.values():
            for p in ps_procs:
                p.terminate()
    print(json.dumps({"mode": mode, "block": block, "counters": counters, "medians": {
        n: {m: round(statistics.median(x[m] for x in v), 3) for m in ("trainer_ms", "shards_ms", "wall_ms")}
        for n, v in out.items()}}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [Path(t).resolve() for t in sys.argv[4:]])
