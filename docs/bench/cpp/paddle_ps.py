"""PaddlePaddle fleet parameter server (a_sync=True, the_one_ps / brpc) on the comparison's workloads.

    FLAGS_enable_pir_api=0 /work/cpp-venvs/paddle/bin/python docs/bench/cpp/paddle_ps.py \
        --workload click --servers 2 --workers 1 --steps 330 --warmup 30

Without --role it is the launcher: it starts the servers and the workers (each its own process group, on
127.0.0.1 and free ports), prints one JSON line per worker and ends every process on every way out.
click: sparse_embedding (16) on the PS (SparseAccessor, per-dim Adagrad StdAdaGradSGDRule lr 0.05), weighted
sum-pooling by segment_sum, fc 16 -> relu -> fc 1, BCE with logits; dense layers by SGD 0.05 on the PS.
mlp: 784-256-256-10, softmax cross-entropy, SGD 0.05 on the PS.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def build(workload, strategy):
    import paddle
    import paddle.distributed.fleet as fleet
    F = paddle.nn.functional
    if workload == "click":
        ids = paddle.static.data("ids", [-1, 1], "int64")
        w = paddle.static.data("w", [-1, 1], "float32")
        seg = paddle.static.data("seg", [-1], "int32")
        label = paddle.static.data("label", [-1, 1], "float32")
        emb = paddle.static.nn.sparse_embedding(
            input=ids, size=[10**9, 16],
            param_attr=paddle.ParamAttr(name="bag", initializer=paddle.nn.initializer.Normal(0.0, 0.1)))
        pooled = paddle.geometric.segment_sum(paddle.reshape(emb, [-1, 16]) * w, seg)
        h = F.relu(paddle.static.nn.fc(pooled, 16))
        logit = paddle.static.nn.fc(h, 1)
        loss = F.binary_cross_entropy_with_logits(logit, label)
        t = strategy.sparse_table_configs.add()
        t.table_name = "bag"
        t.table_class = "MemorySparseTable"
        t.shard_num = 1000
        acc = t.accessor
        acc.accessor_class = "SparseAccessor"
        acc.fea_dim, acc.embedx_dim, acc.embedx_threshold = 16 + 2, 16 - 1, 0
        for sgd in (acc.embed_sgd_param, acc.embedx_sgd_param):
            sgd.name = "StdAdaGradSGDRule"
            sgd.adagrad.learning_rate = common.LR
            sgd.adagrad.initial_g2sum = 1e-10
            sgd.adagrad.initial_range = 0.1
            sgd.adagrad.weight_bounds.extend([-10.0, 10.0])
    else:
        x = paddle.static.data("x", [-1, 784], "float32")
        label = paddle.static.data("label", [-1, 1], "int64")
        h = F.relu(paddle.static.nn.fc(x, 256))
        h = F.relu(paddle.static.nn.fc(h, 256))
        loss = F.cross_entropy(paddle.static.nn.fc(h, 10), label)
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=common.LR), strategy)
    opt.minimize(loss)
    return loss


def dense_puller(fleet, paddle):
    """pull(): this worker's dense parameters fetched from the PS into its scope.  Paddle 3.0's async runtime
    pulls them once, in init_worker, and never again when the loop is exe.run (measured: the worker's dense
    weights stay at their initial values while the PS's move), so the harness pulls them itself."""
    import threading
    from paddle.distributed.ps.utils.public import get_the_one_recv_context
    rt = fleet.fleet._runtime_handle
    dmap = get_the_one_recv_context(rt.context, split_dense_table=rt.is_heter_ps_mode)
    scope = paddle.static.global_scope()

    def pull():
        for tid, names in dmap.items():
            rt._worker.pull_dense_params(scope, tid, names)
    return pull, threading.Event()


def child(a):
    import numpy as np
    import paddle
    import paddle.distributed.fleet as fleet
    from paddle.distributed.fleet.base import role_maker
    paddle.enable_static()
    paddle.set_device("cpu")
    endpoints = [f"127.0.0.1:{p}" for p in a.ports.split(",")]
    role = role_maker.UserDefinedRoleMaker(
        current_id=a.index, role=role_maker.Role.SERVER if a.role == "server" else role_maker.Role.WORKER,
        worker_num=a.workers, server_endpoints=endpoints)
    fleet.init(role)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    loss = build(a.workload, strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    prog = paddle.static.default_main_program()
    stamps = []
    pull, stop = dense_puller(fleet, paddle)
    if a.dense_pull == "thread":
        import threading

        def loop():
            while not stop.is_set():
                pull()
                stop.wait(0.01)
        puller = threading.Thread(target=loop, daemon=True)
    if a.workload == "click":
        arrays = common.click_arrays()
        b0 = common.first_batch(a.index, a.steps)
        batches = []
        for s in range(a.steps):
            ids, off, w, seg, lab = common.click_batch(arrays, b0 + s)
            batches.append({"ids": ids.reshape(-1, 1), "w": w.reshape(-1, 1), "seg": seg,
                            "label": lab.reshape(-1, 1)})
    else:
        arrays = common.mnist_arrays()
        batches = []
        for s in range(a.steps):
            x, y = common.mnist_batch(arrays, s, a.index, a.workers)
            batches.append({"x": x, "label": y.reshape(-1, 1)})
    t0 = time.perf_counter()
    if a.dense_pull == "thread":
        puller.start()
    losses = []
    for s, feed in enumerate(batches):
        (l,) = exe.run(prog, feed=feed, fetch_list=[loss])
        if a.dense_pull == "step":
            pull()
        stamps.append(time.perf_counter())
        if s % 50 == 0 or s == len(batches) - 1:
            losses.append(float(np.asarray(l).mean()))
            if a.debug:
                names = [p.name for p in prog.all_parameters() if p.name != "bag"]
                print("DEBUG", s, {n: float(np.abs(np.array(paddle.static.global_scope().find_var(n).get_tensor())).sum())
                                   for n in names}, file=sys.stderr, flush=True)
    stop.set()
    if a.debug:
        rt = fleet.fleet._runtime_handle
        from paddle.distributed.ps.utils.public import get_the_one_recv_context
        dmap = get_the_one_recv_context(rt.context, split_dense_table=rt.is_heter_ps_mode)
        print("DEBUG dmap", dmap, file=sys.stderr, flush=True)
        for tid, names in dmap.items():
            rt._worker.pull_dense_params(paddle.static.global_scope(), tid, names)
        print("DEBUG after pull", {n: float(np.abs(np.array(paddle.static.global_scope().find_var(n).get_tensor())).sum())
              for names in dmap.values() for n in names}, file=sys.stderr, flush=True)
    common.emit({"rank": a.index, "dense_pull": a.dense_pull, "steps": a.steps, "steps_per_s": common.steady(stamps, a.warmup),
                 "whole_s": stamps[-1] - t0, "losses": losses})
    fleet.stop_worker()


def launch(a):
    common.exit_on_sigterm()
    ports = common.free_ports(a.servers)
    base = [sys.executable, os.path.abspath(__file__), "--workload", a.workload, "--servers", str(a.servers),
            "--workers", str(a.workers), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--ports", ",".join(map(str, ports)), "--dense-pull", a.dense_pull] + (["--debug"] if a.debug else [])
    env = {"FLAGS_enable_pir_api": "0", "CPU_NUM": "1", "GLOG_v": "0"}
    os.makedirs(a.log_dir, exist_ok=True)
    procs = []
    try:
        for i in range(a.servers):
            procs.append(common.spawn(base + ["--role", "server", "--index", str(i)],
                                      f"{a.log_dir}/paddle-server{i}.log", env))
        common.wait_listening(ports, procs=procs)
        workers = [common.spawn(base + ["--role", "worker", "--index", str(i)],
                                f"{a.log_dir}/paddle-worker{i}.log", env) for i in range(a.workers)]
        procs += workers
        results = [common.result_line(p, a.timeout) for p in workers]
        for r in results:
            common.emit(r)
        return results
    finally:
        for p in procs:
            common.kill_group(p)


def parse(argv=None):
    p = common.base_parser(("server", "worker"))
    p.add_argument("--ports", default="")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--dense-pull", choices=("step", "thread", "none"), default="step",
                   help="step: pull the dense weights after every step; thread: a background thread pulls them "
                        "every 10 ms (as Paddle's communicator recv thread would); none: never (Paddle 3.0 as is)")
    p.add_argument("--timeout", type=float, default=600)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    child(args) if args.role else launch(args)
