"""Ad hoc (not ps-bench): what RETIRE frees.  Three real ps-server processes run an 11,176,970-parameter sync job
(ResNet-18's size, SGD with momentum); the script, as rank 0 and as the coordinator, drains the third (3 -> 2) and
prints each process's RSS (VmRSS) after DECIDE and after RETIRE, and its tombstone_bytes_freed.
Run: PYTHONPATH=$PWD python docs/bench/handoff/drain_memory.py (docs/handoff-io.md, "Draining a shard")."""
import dataclasses
import tempfile
import time
from pathlib import Path

import grpc
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.layouts import new_job
from psserver.protocol.proto import ps_pb2 as pb, ps_pb2_grpc as pbg
from psserver.resharding.reshard_cmd import Coordinator
from trainer.local.procs import start_shard

P = 11_176_970
Op = pb.ReshardRequest
job = JobSpec(mode="sync", num_trainers=1, num_shards=3, total_params=P, fingerprint="x",
              optimizer=OptimizerConfig("sgd", lr=0.01, momentum=0.9), tensors=(("w", (P,), "float32"),))
job = dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 3).fingerprint())
job2 = new_job(job, 2)
log_dir = Path(tempfile.mkdtemp())
procs = [start_shard(i, log_dir / f"shard{i}.log") for i in range(3)]
opts = [("grpc.max_receive_message_length", -1)]
stubs = [pbg.ParameterServerStub(grpc.insecure_channel(p.address, options=opts)) for p in procs]
seq = {}


def rss_mb(proc) -> float:
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def push(i, m, epoch, fp):
    a, b = shard_range(P, m, i)
    v = stubs[i].GetStats(pb.StatsRequest(), timeout=30).version
    seq[(i, epoch)] = seq.get((i, epoch), 0) + 1
    h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=fp, dtype=pb.FLOAT32, length=b - a, version=v,
                       num_samples=4, sequence=seq[(i, epoch)], layout_epoch=epoch)
    stubs[i].Push(encode(wire_tensor(torch.randn(b - a), pb.FLOAT32), h, 1 << 20), timeout=60)


try:
    for i in range(3):
        a, b = shard_range(P, 3, i)
        stubs[i].Register(pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=i, job=job.to_proto()), timeout=30)
        h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=job.fingerprint, dtype=pb.FLOAT32, length=b - a)
        stubs[i].Init(encode(wire_tensor(torch.randn(b - a), pb.FLOAT32), h, 1 << 20), timeout=60)
    for _ in range(3):
        for i in range(3):
            push(i, 3, 0, job.fingerprint)
    print("serving 3 shards:", [f"{rss_mb(p):.0f} MB" for p in procs])
    c = Coordinator([p.address for p in procs], [p.address for p in procs[:2]], say=print)
    c.call_all(Op.PREPARE)
    c.wait(lambda r: set(p for p in c.phases(r) if p.startswith("source:")) == {"source:tailing"}, "tailing")
    R = max(c.call(a, Op.PROPOSE).proposal for a in c.old)
    c.call_all(Op.COMMIT, round=R)
    while min(s.GetStats(pb.StatsRequest(), timeout=30).version for s in stubs) < R:
        for i in range(3):
            if stubs[i].GetStats(pb.StatsRequest(), timeout=30).version < R:
                push(i, 3, 0, job.fingerprint)
    c.wait(lambda r: set(c.phases(r)) == {"source:blocked", "dest:ready"}, "blocked")
    c.call_all(Op.DECIDE, switch=True)
    time.sleep(1)  # let the stream threads settle before reading RSS (a measurement, not a synchronisation)
    print("after DECIDE (tombstones, copies, replays held):", [f"{rss_mb(p):.0f} MB" for p in procs])
    replies = c.call_all(Op.RETIRE)
    time.sleep(1)
    print("after RETIRE:", [f"{rss_mb(p):.0f} MB" for p in procs], "drained:", [r.drained for r in replies.values()])
    print("tombstone_bytes_freed:", [int(s.GetStats(pb.StatsRequest(), timeout=30).counters["tombstone_bytes_freed"])
                                     for s in stubs])
    c.close()
finally:
    for p in procs:
        p.kill()
