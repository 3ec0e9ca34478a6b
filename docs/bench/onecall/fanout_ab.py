"""Two shards' unary calls from one trainer step (issue 21, stepspeed2, candidate b): "pool" -- shard 1's call on a
pool thread, shard 0's on the caller's, as trainer.client.map_settled runs them -- against "futures" -- shard 1's
issued as a gRPC future, shard 0's blocking on the caller's thread, then shard 1's result (trainer.step_call's
one_thread).  The calls are GetStats to two real ps-server processes (a small unary call; what a Step adds on the
shard is the same either way).  Blocks of BLOCK pairs alternate, so a loaded machine's drift falls on both; this
process's CPU (all its threads) and the wall time a pair, microseconds; one JSON line a block, then medians.

    PYTHONPATH=$PWD python docs/bench/onecall/fanout_ab.py [BLOCKS_EACH [BLOCK]]
"""
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stubs import method
from trainer.procs import start_shard


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(blocks: int, block: int) -> None:
    run_dir = Path(tempfile.mkdtemp())
    procs = [start_shard(i, run_dir / f"shard{i}.log") for i in range(2)]
    channels = [grpc.insecure_channel(p.address) for p in procs]
    calls = [c.unary_unary(method("GetStats"), pb.StatsRequest.SerializeToString, pb.StatsReply.FromString)
             for c in channels]
    pool = ThreadPoolExecutor(1)
    req = pb.StatsRequest()

    def pooled():
        rest = pool.submit(calls[1], req, timeout=30)
        calls[0](req, timeout=30)
        rest.result()

    def futures():
        rest = calls[1].future(req, timeout=30)
        calls[0](req, timeout=30)
        rest.result()

    ways = {"pool": pooled, "futures": futures}
    out = {w: [] for w in ways}
    try:
        for _ in range(200):
            pooled(), futures()
        for k in range(2 * blocks):
            name = list(ways)[(k + k // 2) % 2]
            c0, w0 = _cpu(), time.perf_counter()
            for _ in range(block):
                ways[name]()
            line = {"way": name, "cpu_us": 1e6 * (_cpu() - c0) / block, "wall_us": 1e6 * (time.perf_counter() - w0) / block,
                    "load_average": os.getloadavg()[0]}
            out[name].append(line)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
    finally:
        for c in channels:
            c.close()
        pool.shutdown()
        for p in procs:
            p.terminate()
    print(json.dumps({"medians": {w: {m: round(statistics.median(x[m] for x in v), 1) for m in ("cpu_us", "wall_us")}
                                  for w, v in out.items()}}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, int(sys.argv[2]) if len(sys.argv) > 2 else 500)
