"""TensorFlow ParameterServerStrategy (tf.distribute, gRPC) on the comparison's workloads.

    /work/cpp-venvs/tf/bin/python docs/bench/cpp/tf_ps.py --workload click --servers 2 --workers 1 --steps 330 --warmup 30

Without --role it is the coordinator (TF's "chief"): it starts the ps and worker tf.distribute.Server processes
(each its own process group, 127.0.0.1, free ports), builds the variables under the strategy, schedules the steps
through ClusterCoordinator (per-worker datasets, so the batches are read on the workers), and ends every process on
every way out.  Steady rate: ``--warmup`` steps scheduled and joined, then the clock runs over ``--steps - warmup``
more steps (scheduled to whichever worker is free, joined at the end).
click: the embedding is a tf.Variable of u x 16 rows (u = the log's distinct ids, ids renumbered 0..u-1: TF has
no hash table embedding in core), partitioned over both ps tasks (FixedShardsPartitioner(2) for it; the small dense
variables are placed whole); weighted sum-pooling by unsorted_segment_sum, Adagrad (lr 0.05, initial accumulator
0, eps 1e-10 as torch) applied row-sparsely on the ps tasks (ResourceSparseApplyAdagradV2 per shard); the head by
SGD 0.05.  mlp: 784-256-256-10, SGD 0.05.  All processes: intra-op threads 1, inter-op 1, except the worker
servers: inter-op 2 (with 1, the first scheduled step never finishes: measured, a deadlock).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

THREADS = dict(intra_op_parallelism_threads=1, inter_op_parallelism_threads=int(os.environ.get("TF_INTER_OP", "1")))


def cluster_spec(ports, servers, workers):
    addr = [f"127.0.0.1:{p}" for p in ports]
    return {"chief": [addr[0]], "ps": addr[1:1 + servers], "worker": addr[1 + servers:1 + servers + workers]}


def server(a):
    import tensorflow as tf
    spec = tf.train.ClusterSpec(json.loads(a.cluster))
    threads = dict(THREADS)
    if a.role == "worker":  # with 1 inter-op thread a worker deadlocks on its first step (measured)
        threads["inter_op_parallelism_threads"] = 2
    if os.environ.get(f"TF_INTER_OP_{a.role.upper()}"):
        threads["inter_op_parallelism_threads"] = int(os.environ[f"TF_INTER_OP_{a.role.upper()}"])
    srv = tf.distribute.Server(spec, job_name=a.role, task_index=a.index, protocol="grpc",
                               config=tf.compat.v1.ConfigProto(**threads), start=True)
    srv.join()


def glorot(shape, seed):
    import tensorflow as tf
    lim = (6.0 / (shape[0] + shape[1])) ** 0.5
    return tf.random.stateless_uniform(shape, (seed, 0), -lim, lim)


def coordinator(a, spec):
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(THREADS["inter_op_parallelism_threads"])
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    click = a.workload == "click"

    def partitioner(shape, dtype):
        return [2, 1] if click and shape[0] > 1000 and a.servers == 2 else [1] * len(shape)
    common.log("strategy")
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
    lr = common.LR
    common.log("variables")
    with strategy.scope():
        if click:
            meta = json.load(open(common.DATA / "meta.json"))
            rows = meta["click_unique_ids"]
            emb = tf.Variable(tf.random.stateless_normal([rows, 16], (1, 0), stddev=0.1), name="bag")
            acc = tf.Variable(tf.zeros([rows, 16]), name="bag_adagrad")
            dense = [tf.Variable(glorot([16, 16], 2), name="w1"), tf.Variable(tf.zeros([16]), name="b1"),
                     tf.Variable(glorot([16, 1], 3), name="w2"), tf.Variable(tf.zeros([1]), name="b2")]
        else:
            dense = [tf.Variable(glorot([784, 256], 1), name="w1"), tf.Variable(tf.zeros([256]), name="b1"),
                     tf.Variable(glorot([256, 256], 2), name="w2"), tf.Variable(tf.zeros([256]), name="b2"),
                     tf.Variable(glorot([256, 10], 3), name="w3"), tf.Variable(tf.zeros([10]), name="b3")]

    steps = a.steps
    if click:
        arrays = common.click_arrays(compact=True)
        per = [[common.click_batch(arrays, b) for b in range(w * steps, (w + 1) * steps)] for w in range(a.workers)]
        width = max(len(b[0]) for p in per for b in p)

        def padded(batches):
            n = len(batches)
            ids = np.zeros((n, width), np.int64)
            ws = np.zeros((n, width), np.float32)
            seg = np.zeros((n, width), np.int32)
            lab = np.stack([b[4] for b in batches])
            cnt = np.array([len(b[0]) for b in batches], np.int32)
            for i, (bi, _, bw, bs, _) in enumerate(batches):
                ids[i, :len(bi)], ws[i, :len(bi)], seg[i, :len(bi)] = bi, bw, bs
            return ids, ws, seg, cnt, lab
        data = [padded(p) for p in per]
    else:
        arrays = common.mnist_arrays()
        data = []
        for w in range(a.workers):
            xs, ys = zip(*(common.mnist_batch(arrays, s, w, a.workers) for s in range(steps)))
            data.append((np.stack(xs), np.stack(ys)))
    # A per-worker dataset cannot ask which worker it runs on, so each worker draws the batches of all workers'
    # runs in its own random order (shuffle with no seed): the same batches as the other systems, not the same order.
    merged = [np.concatenate([d[i] for d in data]) for i in range(len(data[0]))]

    def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices(tuple(merged))
        return ds.shuffle(len(merged[0]), reshuffle_each_iteration=True).repeat() if a.workers > 1 else ds.repeat()
    common.log("datasets")
    it = iter(coord.create_per_worker_dataset(dataset_fn))
    common.log("steps")

    if click:
        @tf.function
        def step(iterator):
            ids, ws, seg, cnt, lab = next(iterator)
            ids, ws, seg = ids[:cnt], ws[:cnt], seg[:cnt]
            uniq, idx = tf.unique(ids)
            with tf.GradientTape() as tape:
                tape.watch(dense)
                rowsv = tf.nn.embedding_lookup(emb, uniq)
                tape.watch(rowsv)
                pooled = tf.math.unsorted_segment_sum(tf.gather(rowsv, idx) * ws[:, None], seg, 512)
                h = tf.nn.relu(pooled @ dense[0] + dense[1])
                logit = tf.squeeze(h @ dense[2] + dense[3], -1)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=lab, logits=logit))
            grads = tape.gradient(loss, dense + [rowsv])
            for v, g in zip(dense, grads[:-1]):
                v.assign_sub(lr * g)
            g = grads[-1]
            shards = emb.variables if hasattr(emb, "variables") else [emb]
            accs = acc.variables if hasattr(acc, "variables") else [acc]
            start = 0
            for vs, va in zip(shards, accs):
                size = vs.shape[0]
                mask = (uniq >= start) & (uniq < start + size)
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=vs.handle, accum=va.handle, lr=tf.constant(lr), epsilon=tf.constant(1e-10),
                    grad=tf.boolean_mask(g, mask), indices=tf.boolean_mask(uniq, mask) - start)
                start += size
            return loss
    else:
        @tf.function
        def step(iterator):
            x, y = next(iterator)
            with tf.GradientTape() as tape:
                h = tf.nn.relu(x @ dense[0] + dense[1])
                h = tf.nn.relu(h @ dense[2] + dense[3])
                logits = h @ dense[4] + dense[5]
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            for v, g in zip(dense, tape.gradient(loss, dense)):
                v.assign_sub(lr * g)
            return loss

    total_warm = a.warmup * a.workers
    first = [coord.schedule(step, args=(it,)) for _ in range(total_warm)]
    coord.join()
    common.log("warm-up done", float(first[-1].fetch()))
    t0 = time.perf_counter()
    rest = [coord.schedule(step, args=(it,)) for _ in range((steps - a.warmup) * a.workers)]
    coord.join()
    t1 = time.perf_counter()
    n = len(rest)
    losses = [float(first[0].fetch()), float(rest[-1].fetch())]
    return {"steps_per_s": n / (t1 - t0) / a.workers, "total_steps_per_s": n / (t1 - t0), "timed_steps": n,
            "losses": losses, "partitions": [len(getattr(emb, "variables", [0]))] if click else None}


def launch(a):
    common.exit_on_sigterm()
    ports = common.free_ports(1 + a.servers + a.workers)
    spec = cluster_spec(ports, a.servers, a.workers)
    os.makedirs(a.log_dir, exist_ok=True)
    base = [sys.executable, os.path.abspath(__file__), "--cluster", json.dumps(spec)]
    env = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"), "CUDA_VISIBLE_DEVICES": ""}
    procs = []
    try:
        for job in ("ps", "worker"):
            for i in range(len(spec[job])):
                procs.append(common.spawn(base + ["--role", job, "--index", str(i)], f"{a.log_dir}/tf-{job}{i}.log", env))
        common.wait_listening(ports[1:], procs=procs)
        r = coordinator(a, spec)
        r.update(workload=a.workload, servers=a.servers, workers=a.workers, steps=a.steps, warmup=a.warmup)
        common.emit(r)
        return r
    finally:
        for p in procs:
            common.kill_group(p)


def parse(argv=None):
    p = common.base_parser(("ps", "worker"))
    p.add_argument("--cluster", default="")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    server(args) if args.role else launch(args)
