"""What serialising a dense slice's state costs the primary a shipment (psserver.state.checkpoint.ShardState): as a
checkpoint file (zip format + SHA-256) and as a standby's shipment (plain format, no digest), CPU per call, for
a slice of N floats with Adam's two moments -- the CNN's half (53K), a 1M slice and ResNet-18's half (5.6M).

    PYTHONPATH=$PWD python docs/bench/standby/shipment_cost.py
"""
import json
import time

import torch

from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.state.checkpoint import ShardState


def state(n: int) -> ShardState:
    spec = JobSpec(mode="sync", num_trainers=2, num_shards=2, total_params=2 * n, fingerprint="f" * 16,
                   optimizer=OptimizerConfig("adam", lr=1e-3), tensors=(("w", (2 * n,), "float32"),))
    return ShardState(shard=0, version=7, job=spec, params=torch.randn(n),
                      optimizer={"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(n),
                                               "exp_avg_sq": torch.rand(n)}},
                                 "param_groups": [{"lr": 1e-3, "params": [0]}]})


def cpu_us(fn, seconds: float = 1.0) -> float:
    fn()
    n, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        fn()
        n += 1
    return 1e6 * (time.process_time() - start) / n


torch.set_num_threads(1)  # a shard's default
for n in (53_000, 1_000_000, 5_600_000):
    s = state(n)
    file_us, ship_us = cpu_us(s.to_bytes), cpu_us(lambda: s.to_bytes(shipment=True))
    print(json.dumps({"floats": n, "bytes": len(s.to_bytes(shipment=True)), "checkpoint_us": round(file_us),
                      "shipment_us": round(ship_us), "shipment_over_checkpoint": round(ship_us / file_us, 2)}))
