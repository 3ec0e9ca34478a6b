"""The shard's side of a small Step (issue 21, stepspeed2, candidate a): the same one-message step -- a dense slice
of 1,000 floats and one table part (PULL ids pulled, 16 pushed, dim 4, sync, one trainer) -- answered by the Step
RPC's stream-stream handler (read by the trainer with a unary call, one_reply) against the unary StepOnce handler,
on one real ps-server process.  Blocks of BLOCK steps alternate (A B B A ...), each step under the next numbers, so
a loaded machine's drift falls on both; the shard's CPU (all its threads, /proc) and this process's, microseconds
a step; one JSON line a block, then medians.

    PYTHONPATH=$PWD python docs/bench/onecall/handler_ab.py [BLOCKS_EACH [BLOCK [PULL]]]
"""
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P, RawShard
from tests.integration.test_sparse_rpc import job, rows_chunks
from tests.integration.test_step_rpc import rows
from trainer.local.procs import start_shard
from trainer.tools.procstat import sample


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(blocks: int, block: int, pull: int) -> None:
    proc = start_shard(0, Path(tempfile.mkdtemp()) / "shard0.log")
    raw = RawShard(SimpleNamespace(address=proc.address))
    ways = {"step": raw.channel.unary_unary(method("Step"), serialize_step, parse_step),
            "once": raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)}
    out = {w: [] for w in ways}
    grad, k = torch.full((P,), 1e-3), 0
    try:
        raw.register(spec=job(num_embeddings=1 << 20))
        raw.init(torch.zeros(P), chunk_bytes=1 << 20)

        def step(call):
            nonlocal k
            k += 1
            h = raw.header(sequence=k, version=k - 1)
            msgs = [StepMessage(0, dense=c) for c in encode(wire_tensor(grad, h.dtype), h, 1 << 20)] + rows(
                1, rows_chunks(list(range(16)), seq=k, base=k - 1), list(range(k % 1000, k % 1000 + pull)))
            call(one_message(msgs, True), timeout=30)

        for _ in range(200):
            step(ways["step"]), step(ways["once"])
        for b in range(2 * blocks):
            name = list(ways)[(b + b // 2) % 2]
            s0, c0, w0 = sample(proc.popen.pid)["cpu"], _cpu(), time.perf_counter()
            for _ in range(block):
                step(ways[name])
            line = {"way": name, "shard_us": 1e6 * (sample(proc.popen.pid)["cpu"] - s0) / block,
                    "client_us": 1e6 * (_cpu() - c0) / block, "wall_us": 1e6 * (time.perf_counter() - w0) / block,
                    "load_average": os.getloadavg()[0]}
            out[name].append(line)
            print(json.dumps({m: round(v, 1) if isinstance(v, float) else v for m, v in line.items()}), flush=True)
    finally:
        raw.close()
        proc.terminate()
    print(json.dumps({"pull": pull, "block": block, "medians": {
        w: {m: round(statistics.median(x[m] for x in v), 1) for m in ("shard_us", "client_us", "wall_us")}
        for w, v in out.items()}}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, int(sys.argv[2]) if len(sys.argv) > 2 else 1000,
         int(sys.argv[3]) if len(sys.argv) > 3 else 600)
