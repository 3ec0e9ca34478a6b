"""A shard's RSS growth against its own table accounting (GetStats memory_tables_bytes) for a table job with big
calls: pulls of IDS new ids, each followed by a push of their gradient rows, until ROWS rows (async table,
Adagrad).  Also the allocator's free heap, its bound and the trims the shard made (psserver.state.heap).

    PYTHONPATH=$PWD python docs/bench/memory/heap_rss.py [DIM [ROWS [IDS]]]
"""
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.rows import idpack
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.stubs import fetch_stat
from trainer.local.procs import start_shard

FP = "f" * 16


def rss(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024


def main(dim: int, rows: int, batch: int) -> None:
    spec = JobSpec(mode="async", num_trainers=1, num_shards=1, total_params=4, fingerprint=FP,
                   optimizer=OptimizerConfig("sgd", lr=0.05), tensors=(("w", (4,), "float32"),),
                   tables=(TableSpec("t", dim, optimizer=SparseOptimizerConfig("adagrad", lr=0.05), seed=7,
                                     mode="async"),))
    shard = start_shard(0, Path(tempfile.mkdtemp()) / "shard.log")
    try:
        channel = grpc.insecure_channel(shard.address, options=[("grpc.max_receive_message_length", -1)])
        stub = pb_grpc.ParameterServerStub(channel)
        stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=spec.to_proto()), timeout=30)
        base = rss(shard.popen.pid)
        for k in range(rows // batch):
            ids = torch.arange(k * batch, (k + 1) * batch, dtype=torch.int64) * 7 + 3
            list(stub.PullRows(pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="t",
                                                  packed_ids=idpack.pack(ids)), timeout=60))
            h = pb.RowsHeader(rank=0, trainer_id="t0", fingerprint=FP, table="t", version=k, num_samples=1,
                              sequence=k + 1, dim=dim, num_ids=batch)
            stub.PushRows(iter([pb.RowsChunk(header=h, ids=ids.numpy().tobytes(),
                                             rows=torch.full((batch, dim), 1e-3).numpy().tobytes())]), timeout=60)
        time.sleep(2.5)  # (a measurement: the shard's once-a-second heap check has run)
        c = fetch_stat(shard.address).counters
        grown = rss(shard.popen.pid) - base
        print(json.dumps({"dim": dim, "rows": rows, "ids_per_call": batch,
                          "tables_counted_MB": round(c["memory_tables_bytes"] / 1e6, 1),
                          "rss_growth_MB": round(grown / 1e6, 1),
                          "counted_over_rss_growth": round(c["memory_tables_bytes"] / grown, 3),
                          "heap_free_MB": round(c.get("memory_heap_free_bytes", 0) / 1e6, 1),
                          "heap_bound_MB": round(c.get("memory_heap_bound_bytes", 0) / 1e6, 1),
                          "heap_trims": c.get("memory_heap_trims", 0),
                          "heap_trimmed_MB": round(c.get("memory_heap_trimmed_bytes", 0) / 1e6, 1)}))
        channel.close()
    finally:
        shard.terminate()


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:]]
    main(*(a + [16, 2_000_000, 100_000][len(a):]))
