"""Ad hoc (not ps-bench yet): a 2 -> 3 live re-shard of a sync job with a 1,000,000-row table (dim 16, Adagrad) beside
a small dense slice; every row made live first, then one pusher thread drives rounds (the dense slice and 4,096 rows
on both old shards, some of them new) while `ps-server reshard` runs in-process.
Run: PYTHONPATH=$PWD python docs/bench/handoff/measure_rows.py [ROWS] (docs/handoff-io.md, "Tables: measured")."""
import dataclasses, sys, threading, time
import grpc, torch
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.proto import ps_pb2 as pb, ps_pb2_grpc as pbg
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rows.wire import row_chunks
from psserver.resharding.reshard_cmd import reshard_main
from psserver.serving.server import ServerConfig, ShardServer

ROWS, DIM, P, BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000, 16, 4096, 4096
table = TableSpec("emb", DIM, optimizer=SparseOptimizerConfig("adagrad", lr=0.05), seed=1)
job = JobSpec(mode="sync", num_trainers=1, num_shards=2, total_params=P, fingerprint="x",
              optimizer=OptimizerConfig("sgd", lr=0.01), tensors=(("w", (P,), "float32"),), tables=(table,))
job = dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 2).fingerprint())
servers = [ShardServer(ServerConfig(shard=i, host="127.0.0.1", port=0, lease_timeout=0)).start() for i in range(3)]
opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
stubs = [pbg.ParameterServerStub(grpc.insecure_channel(s.address, options=opts)) for s in servers]
seq, rseq = [0, 0], [0, 0]
def hdr(i, n, v):
    seq[i] += 1
    return pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, dtype=pb.FLOAT32, length=n, version=v,
                          num_samples=4, sequence=seq[i])
def push_round(i, v, ids):
    """One round on old shard i: the dense slice, then the rows of ``ids`` (its own), both of base v."""
    stubs[i].Push(encode(wire_tensor(grads[i], pb.FLOAT32), hdr(i, grads[i].numel(), v), 1 << 20), timeout=120)
    rseq[i] += 1
    h = pb.RowsHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, table="emb", version=v, num_samples=4,
                      sequence=rseq[i], dim=DIM, num_ids=len(ids))
    stubs[i].PushRows(row_chunks(torch.full((len(ids), DIM), 0.01), h, 1 << 20, ids), timeout=300)
for i in range(2):
    a, b = shard_range(P, 2, i)
    stubs[i].Register(pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=i, job=job.to_proto()), timeout=30)
    h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, dtype=pb.FLOAT32, length=b - a)
    stubs[i].Init(encode(wire_tensor(torch.randn(b - a), pb.FLOAT32), h, 1 << 20), timeout=60)
grads = [torch.randn(b - a) for a, b in (shard_range(P, 2, i) for i in range(2))]
every = torch.arange(ROWS, dtype=torch.int64)
owned = [every[shard_of(every, 2) == i] for i in range(2)]
t = time.monotonic()
for i in range(2):  # every row made live: one round each shard (its rows, one push)
    push_round(i, 0, owned[i])
print(f"{ROWS} rows live in {time.monotonic() - t:.1f}s: {[int(s.layouts.current.head.tables.get('emb').stats['live_rows']) for s in servers[:2]]}")
gen = torch.Generator().manual_seed(0)
stop = threading.Event(); rounds = []
def pusher():
    while not stop.is_set():
        t0 = time.monotonic(); pushed = 0
        for i in range(2):
            R = stubs[i].Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=30).round
            v = servers[i].layouts.host(0).head.tables.get("emb").version
            if not R or v < R:
                ids = torch.unique(torch.randint(0, ROWS + ROWS // 10, (BATCH,), generator=gen))  # ~9% new rows
                push_round(i, v, ids[shard_of(ids, 2) == i])
                pushed += 1
        if pushed == 2:
            rounds.append((t0, time.monotonic()))
        else:
            time.sleep(0.01)  # held at R until DECIDE: not a round
th = threading.Thread(target=pusher); th.start()
time.sleep(3)
t0 = time.monotonic()
rc = reshard_main(["--ps", ",".join(s.address for s in servers[:2]), "--to", ",".join(s.address for s in servers),
                   "--wait", "600"])
t1 = time.monotonic(); stop.set(); th.join()
before = [b - a for a, b in rounds if b < t0]; during = [b - a for a, b in rounds if a >= t0 and b <= t1]
print(f"rc={rc} hand-off={t1-t0:.2f}s rounds before={len(before)} mean={sum(before)/max(len(before),1)*1000:.0f}ms "
      f"during={len(during)} mean={sum(during)/max(len(during),1)*1000:.0f}ms")
for s in servers:
    c = s.layouts.host(0).head.counters
    print({k: v for k, v in c.items() if k.startswith("handoff")})
print("rows per new shard:", [int(s.layouts.current.head.tables.get("emb").stats["live_rows"]) for s in servers])
for s in servers: s.stop(grace=0)
