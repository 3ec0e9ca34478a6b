"""A hot standby's cost on a big table: one shard (and its standby) serving an async table of ROWS rows of dim 16
(Adagrad), stepped as a click model's trainer steps it -- each step a pull of the next batch's ids (~IDS of
them, a quarter new) and a push of this batch's gradient rows -- without a standby and with one.  Reports steps/s,
the bytes a shipment carried and the shard's CPU a step; run it from two checkouts to compare them.

    PYTHONPATH=$PWD python docs/bench/standby/big_table.py [ROWS [STEPS [IDS]]]
"""
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from tests.conftest import P, RawShard, make_spec
from tests.helpers import wait_until
from trainer.local.procs import free_port, start_etcd, start_shard
from trainer.tools.procstat import sample

FP, DIM = "f" * 16, 16


def pull(raw, ids):
    req = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="emb", ids=ids.numpy().tobytes())
    list(raw.stub.PullRows(req, timeout=60))


def push(raw, ids, seq):
    h = pb.RowsHeader(rank=0, trainer_id="t0", fingerprint=FP, table="emb", version=seq - 1, num_samples=512,
                      sequence=seq, dim=DIM, num_ids=len(ids))
    chunk = pb.RowsChunk(header=h, ids=ids.numpy().tobytes(), rows=torch.full((len(ids), DIM), 1e-3).numpy().tobytes())
    assert raw.stub.PushRows(iter([chunk]), timeout=60).outcome == pb.APPLIED


def run(standby: bool, rows: int, steps: int, ids_per_step: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="standby-big-"))
    procs = []
    try:
        if standby:
            etcd = start_etcd(tmp / "etcd", tmp / "etcd.log")
            procs.append(etcd)
            for name in "ab":
                procs.append(start_shard(0, tmp / f"{name}.log", port=free_port(), extra_args=[
                    "--etcd", etcd.address, "--job-name", "big", "--replica", name]))
            wait_until(lambda: "caught up" in procs[1].log_path.read_text(), "the standby in sync", timeout=120)
        else:
            procs.append(start_shard(0, tmp / "a.log"))
        primary = procs[1] if standby else procs[0]
        spec = make_spec(mode="async", tables=(TableSpec("emb", DIM, optimizer=SparseOptimizerConfig(
            "adagrad", lr=0.05), seed=7, mode="async"),))
        g = torch.Generator().manual_seed(0)
        with RawShard(SimpleNamespace(address=primary.address)) as raw:
            raw.register(spec=spec)
            raw.init(torch.zeros(P), chunk_bytes=1 << 20)
            for start in range(0, rows, 100_000):
                pull(raw, torch.arange(start, min(rows, start + 100_000)))
            batches = [torch.unique(torch.cat([torch.randint(0, rows, (3 * ids_per_step // 4,), generator=g),
                                               torch.randint(rows, 10 * rows, (ids_per_step // 4,), generator=g)]))
                       for _ in range(steps + 1)]
            before = raw.stats().counters
            cpu0, t0 = sample(primary.popen.pid)["cpu"], time.perf_counter()
            for k in range(steps):
                pull(raw, batches[k + 1])
                push(raw, batches[k], k + 1)
            wall, cpu = time.perf_counter() - t0, sample(primary.popen.pid)["cpu"] - cpu0
            after = raw.stats().counters
        ships = after.get("replica_shipments", 0) - before.get("replica_shipments", 0)
        shipped = after.get("replica_bytes", 0) - before.get("replica_bytes", 0)
        return {"standby": standby, "rows": rows, "steps": steps, "steps_per_s": round(steps / wall, 1),
                "primary_cpu_ms_per_step": round(1e3 * cpu / steps, 2), "shipments": ships,
                "bytes_per_shipment": round(shipped / ships) if ships else 0,
                "partial_shipments": after.get("replica_shipments_since", 0) - before.get("replica_shipments_since", 0)}
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:]]
    rows, steps, ids = (a + [1_000_000, 200, 1300][len(a):])
    for standby in (False, True):
        print(json.dumps(run(standby, rows, steps, ids)), flush=True)
