"""Ad hoc (issue 24): measure_rows.py's 2 -> 3 live re-shard of a 1,000,000-row sync table, with what a trainer's
heartbeat sees meanwhile: a probe on each old shard's event loop (``asyncio.sleep(0.01)`` ticking, its worst
lateness while the hand-off runs), a Heartbeat sent to each old shard every 0.1 s (the slowest answer), and the
shards' ``lease_expired`` with a 5 s lease that the heartbeats keep renewing.
Run: PYTHONPATH=$PWD python docs/bench/handoff/measure_rows_lag.py [ROWS] (docs/handoff-io.md, "Heartbeats during a
rows copy")."""
import asyncio, dataclasses, sys, threading, time
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

ROWS, DIM, P, BATCH, LEASE = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000, 16, 4096, 4096, 5.0
table = TableSpec("emb", DIM, optimizer=SparseOptimizerConfig("adagrad", lr=0.05), seed=1)
job = JobSpec(mode="sync", num_trainers=1, num_shards=2, total_params=P, fingerprint="x",
              optimizer=OptimizerConfig("sgd", lr=0.01), tensors=(("w", (P,), "float32"),), tables=(table,))
job = dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 2).fingerprint())
if __import__("os").environ.get("LAG_SAMPLE"):  # how long the plan's lock is held by the rows' steps
    import psserver.resharding.handoff.shard_rows as hir
    held = {}
    def timed(cls, name):
        fn = getattr(cls, name)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                held.setdefault(name, []).append(round(time.perf_counter() - t, 3))
        setattr(cls, name, wrapper)
    for cls, name in ((hir.RowsHandoff, "snapshot"), (hir.RowsHandoff, "vote"), (hir.RowsHandoff, "receive"),
                      (hir.RowsHandoff, "table_closed"), (hir.RowsSource, "_send")):
        timed(cls, name)
    import atexit; atexit.register(lambda: print("held (s):", {k: sorted(v)[-6:] for k, v in held.items()}))
servers = [ShardServer(ServerConfig(shard=i, host="127.0.0.1", port=0, lease_timeout=LEASE)).start() for i in range(3)]
opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
stubs = [pbg.ParameterServerStub(grpc.insecure_channel(s.address, options=opts)) for s in servers]
hb_stubs = [pbg.ParameterServerStub(grpc.insecure_channel(s.address, options=opts)) for s in servers]
seq, rseq = [0, 0], [0, 0]
def hdr(i, n, v):
    seq[i] += 1
    return pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, dtype=pb.FLOAT32, length=n, version=v,
                          num_samples=4, sequence=seq[i])
def push_round(i, v, ids):
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
for i in range(2):
    push_round(i, 0, owned[i])
stop = threading.Event(); rounds = []; lag = [0.0, 0.0]; hb = [0.0, 0.0]; hb_fail = [0, 0]
async def probe(i):
    while not stop.is_set():
        t = time.monotonic(); await asyncio.sleep(0.01)
        lag[i] = max(lag[i], time.monotonic() - t - 0.01)
def heartbeats():
    while not stop.is_set():
        for i in range(2):
            t = time.monotonic()
            try:
                hb_stubs[i].Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id="t0", fingerprint=job.fingerprint),
                                      timeout=60)
            except grpc.RpcError:
                hb_fail[i] += 1
            hb[i] = max(hb[i], time.monotonic() - t)
        stop.wait(0.1)
gen = torch.Generator().manual_seed(0)
def pusher():
    try:
        push_rounds()
    except Exception as e:  # the switch: the old layout's calls are refused layout-moved from here on
        print("pusher stopped:", str(e)[:80])
def push_rounds():
    while not stop.is_set():
        t0 = time.monotonic(); pushed = 0
        for i in range(2):
            R = stubs[i].Reshard(pb.ReshardRequest(op=pb.ReshardRequest.STATUS), timeout=30).round
            v = servers[i].layouts.host(0).head.tables.get("emb").version
            if not R or v < R:
                ids = torch.unique(torch.randint(0, ROWS + ROWS // 10, (BATCH,), generator=gen))
                push_round(i, v, ids[shard_of(ids, 2) == i])
                pushed += 1
        if pushed == 2:
            rounds.append((t0, time.monotonic()))
        else:
            stop.wait(0.01)
def sampler():
    """LAG_SAMPLE=1: while an old shard's loop is late, where every thread is (what holds the loop or the GIL)."""
    import collections, os, sys, traceback
    if not os.environ.get("LAG_SAMPLE"):
        return
    seen = collections.Counter()
    while not stop.wait(0.01):
        late = [s for s in servers[:2] if time.monotonic() - s._watch._due > 0.05]
        if not late:
            continue
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            st = traceback.extract_stack(frame)[-3:]
            seen[(names.get(ident, "?"), " < ".join(f"{f.name}:{f.lineno}" for f in reversed(st)))] += 1
    for (n, k), c in seen.most_common(30):
        print(c, n, k)
threads = [threading.Thread(target=pusher), threading.Thread(target=heartbeats), threading.Thread(target=sampler)]
for th in threads: th.start()
stop.wait(3)
before = (list(lag), list(hb)); lag[:] = [0.0, 0.0]; hb[:] = [0.0, 0.0]
probes = [asyncio.run_coroutine_threadsafe(probe(i), servers[i]._loop) for i in range(2)]
t0 = time.monotonic()
rc = reshard_main(["--ps", ",".join(s.address for s in servers[:2]), "--to", ",".join(s.address for s in servers),
                   "--wait", "600"])
t1 = time.monotonic(); stop.set()
for th in threads: th.join()
for p in probes: p.result(10)
during = [b - a for a, b in rounds if a >= t0 and b <= t1]
print(f"rc={rc} hand-off={t1-t0:.2f}s rounds during={len(during)} max={max(during, default=0):.2f}s")
print(f"before PREPARE (3 s, heartbeats only): worst heartbeat {max(before[1]):.3f}s")
print(f"during: worst loop lag per old shard {[round(x, 3) for x in lag]} s; worst heartbeat {[round(x, 3) for x in hb]} s;"
      f" heartbeat failures {hb_fail}")
for s in servers[:2]:
    c = s.layouts.current.head.counters
    print({k: c.get(k, 0) for k in ("lease_expired", "rejoins", "handoff_row_copies_sent", "handoff_row_recopies")})
for s in servers: s.stop(grace=0)
