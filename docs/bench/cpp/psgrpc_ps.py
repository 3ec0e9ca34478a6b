"""psgrpc (this repository) on the comparison's workloads, as a user runs it: ``ps-server`` shards started by
trainer.local.procs.start_shard (``--torch-threads 1``), trainer processes calling trainer.stepping.api.connect.

    PYTHONPATH=. .venv/bin/python docs/bench/cpp/psgrpc_ps.py \
        --workload click --servers 2 --workers 1 --steps 330 --warmup 30 --push-window 4
    ... --workload click --single      # one process, nn.EmbeddingBag(sparse=True) (sparsebench's reference)

Fully async: ``connect(mode="async", embedding_mode="async", push_window=W)``; the click model's rows are
prefetched one batch ahead (``ps.prefetching``), as trainer.tools.sparsebench.sharded_rate does.  click:
trainer.workloads.recmodels.ClickModel over sharded_factories (Adagrad 0.05 on the shards), head by SGD 0.05;
mlp: trainer.workloads.models.MLP (784-256-256-10), SGD 0.05 (no momentum).  Trainers: torch.set_num_threads(1).
Without --role it is the launcher (shards, then one process per worker; every process group ended on every way
out); --role worker is one trainer.
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def worker(a):
    import torch
    torch.set_num_threads(1)
    from trainer.stepping.api import connect
    lr = common.LR
    stamps, losses = [], []
    if a.workload == "click":
        from psserver.protocol.rows.optim import SparseOptimizerConfig
        from trainer.workloads.recmodels import ClickModel, sharded_factories
        from trainer.tools.sparsebench import one_process_step
        arrays = common.click_arrays(compact=a.single)
        b0 = common.first_batch(a.index, a.steps)
        batches = []
        for s in range(a.steps):
            ids, off, w, _seg, lab = common.click_batch(arrays, b0 + s)
            batches.append(tuple(torch.from_numpy(x) for x in (ids, off, w, lab)))
        loss_fn = torch.nn.BCEWithLogitsLoss()
        torch.manual_seed(0)
        if a.single:
            model = ClickModel(int(arrays[0].max()) + 1, 16)
            step = one_process_step(model, lr)
            t0 = time.perf_counter()
            for i, (ids, off, w, lab) in enumerate(batches):
                loss = loss_fn(model(ids, off, w), lab)
                loss.backward()
                step(len(lab))
                stamps.append(time.perf_counter())
                if i % 50 == 0 or i == a.steps - 1:
                    losses.append(float(loss))
            return done(a, stamps, t0, losses)
        model = ClickModel(10**9, 16, embedding_bag=sharded_factories(SparseOptimizerConfig("adagrad", lr=lr))[
            "embedding_bag"])
        with connect(a.ps, model, mode="async", embedding_mode="async", optimizer={"name": "sgd", "lr": lr},
                     rank=a.index, num_trainers=a.workers, push_window=a.push_window) as ps:
            t0 = time.perf_counter()
            for i, (ids, off, w, lab) in enumerate(ps.prefetching(batches, ids_of=lambda b: {"bag": b[0]})):
                loss = loss_fn(model(ids, off, w), lab)
                loss.backward()
                ps.step(len(lab))
                ps.zero_grad()
                stamps.append(time.perf_counter())
                if i % 50 == 0 or i == a.steps - 1:
                    losses.append(float(loss))
            r = done(a, stamps, t0, losses)
        return r
    from trainer.workloads.models import build_model
    arrays = common.mnist_arrays()
    batches = [tuple(torch.from_numpy(x) for x in common.mnist_batch(arrays, s, a.index, a.workers))
               for s in range(a.steps)]
    model = build_model("mlp", (784,), 10, seed=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    with connect(a.ps, model, mode="async", optimizer={"name": "sgd", "lr": lr, "momentum": 0.0},
                 rank=a.index, num_trainers=a.workers, push_window=a.push_window) as ps:
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(batches):
            loss = loss_fn(model(x), y)
            loss.backward()
            ps.step(len(y))
            stamps.append(time.perf_counter())
            if i % 50 == 0 or i == a.steps - 1:
                losses.append(float(loss))
        return done(a, stamps, t0, losses)


def done(a, stamps, t0, losses):
    r = {"rank": a.index, "push_window": a.push_window, "steps": a.steps,
         "steps_per_s": common.steady(stamps, a.warmup), "whole_s": stamps[-1] - t0, "losses": losses}
    common.emit(r)
    return r


def launch(a):
    common.exit_on_sigterm()
    from trainer.local.procs import start_shard
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    shards, workers = [], []
    args = [sys.executable, os.path.abspath(__file__), "--workload", a.workload, "--workers", str(a.workers),
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--push-window", str(a.push_window)]
    env = {"PYTHONPATH": str(common.HERE.parents[2])}
    try:
        if not a.single:
            shards = [start_shard(i, log_dir / f"psgrpc-shard{i}.log", extra_args=["--torch-threads", "1"])
                      for i in range(a.servers)]
            args += ["--ps", ",".join(s.address for s in shards)]
        else:
            args += ["--single"]
        workers = [common.spawn(args + ["--role", "worker", "--index", str(i)], log_dir / f"psgrpc-worker{i}.log",
                                env) for i in range(1 if a.single else a.workers)]
        results = [common.result_line(p, a.timeout) for p in workers]
        for r in results:
            common.emit(r)
        return results
    finally:
        for p in workers:
            common.kill_group(p)
        for s in shards:
            s.terminate()
            if s.alive():
                s.kill()


def parse(argv=None):
    p = common.base_parser(("worker",))
    p.add_argument("--push-window", type=int, default=1)
    p.add_argument("--single", action="store_true", help="click only: one process, no shards")
    p.add_argument("--ps", default="")
    p.add_argument("--timeout", type=float, default=600)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    worker(args) if args.role else launch(args)
