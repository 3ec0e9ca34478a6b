"""What a shipment of a shard's state costs to write (the primary, once a round, on its state worker) and to read
(the standby), CPU per call, three ways: as a checkpoint file (torch's zip format + SHA-256), in torch's plain
format (what shipments used before 2026-12-04) and as a shipment now (psserver.state.raw_tree: a JSON skeleton and
the tensors' bytes).  States: a dense slice of N floats with Adam's two moments -- the CNN's half (53K), a 1M slice,
ResNet-18's half (5.6M) -- and a click model's shard (26 tables of 500-6,500 rows of dim 16 with Adagrad state
and their books, ~180 tensors, about what a DLRM shipment on criteo-synth carries).

    PYTHONPATH=$PWD python docs/bench/standby/shipment_cost.py
"""
import io
import json
import time

import torch

from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.state.checkpoint import ShardState


def dense(n: int) -> ShardState:
    spec = JobSpec(mode="sync", num_trainers=2, num_shards=2, total_params=2 * n, fingerprint="f" * 16,
                   optimizer=OptimizerConfig("adam", lr=1e-3), tensors=(("w", (2 * n,), "float32"),))
    return ShardState(shard=0, version=7, job=spec, params=torch.randn(n),
                      optimizer={"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(n),
                                               "exp_avg_sq": torch.rand(n)}},
                                 "param_groups": [{"lr": 1e-3, "params": [0]}]})


def clicks() -> ShardState:
    s = dense(1_000)
    g = torch.Generator().manual_seed(0)
    tables = {}
    for t in range(26):
        n = 500 + (6_000 * t) // 25 if t % 3 == 0 else 500
        tables[f"C{t}"] = {
            "rows": {"ids": torch.randperm(10 * n, generator=g)[:n], "rows": torch.randn(n, 16, generator=g),
                     "state": torch.rand(n, 16, generator=g), "last_tick": torch.arange(n),
                     "last_version": torch.arange(n), "tick": 40, "evictions": 0},
            "version": 40, "round": None, "acked": {0: ("t0", 40, "applied", 40, 0), 1: ("t1", 40, "applied", 40, 0)},
            "updated_at": torch.arange(n) % 40, "counts": {k: 7 for k in ("rows_created", "pushes", "pulls")},
            "holes": {}}
    s.tables = tables
    return s


def cpu_us(fn, seconds: float = 1.0) -> float:
    fn()
    n, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        fn()
        n += 1
    return 1e6 * (time.process_time() - start) / n


def plain(s: ShardState) -> bytes:
    """torch's plain format of the state's fields: what a shipment was before."""
    buf = io.BytesIO()
    torch.save(dict(params=s.params, optimizer=s.optimizer, tables=s.tables, acked=s.acked), buf,
               _use_new_zipfile_serialization=False)
    return buf.getvalue()


torch.set_num_threads(1)  # a shard's default
for name, s in [("dense 53K", dense(53_000)), ("dense 1M", dense(1_000_000)), ("dense 5.6M", dense(5_600_000)),
                ("click model", clicks())]:
    shipped, old, file = s.to_bytes(shipment=True), plain(s), s.to_bytes()
    row = {"state": name, "bytes": len(shipped),
           "write_us": {"checkpoint": round(cpu_us(s.to_bytes)), "torch_plain": round(cpu_us(lambda: plain(s))),
                        "shipment": round(cpu_us(lambda: s.to_bytes(shipment=True)))},
           "read_us": {"checkpoint": round(cpu_us(lambda: ShardState.from_bytes(file))),
                       "torch_plain": round(cpu_us(lambda: torch.load(io.BytesIO(old), weights_only=True))),
                       "shipment": round(cpu_us(lambda: ShardState.from_bytes(shipped, shipment=True)))}}
    print(json.dumps(row), flush=True)
