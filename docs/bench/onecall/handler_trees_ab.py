"""The shard's side of a small StepOnce (issue 21, smallwork), isolated, against shards of two or more source trees
at once: the handler_ab.py step -- a dense slice of 1,000 floats and one table part (PULL ids pulled, 16 pushed,
dim 4, sync, one trainer; a table that stays small, so its work runs on the loop in every tree) -- sent as StepOnce
to one ps-server per TREE (run from that tree).  Blocks of BLOCK steps take turns between the trees, the order
rotated each round, so a loaded machine's drift falls on all; the shard's CPU (all its threads, /proc) and this
process's, microseconds a step; one JSON line a block, then medians.

    PYTHONPATH=$PWD python docs/bench/onecall/handler_trees_ab.py BLOCKS_EACH BLOCK PULL TREE...
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


def main(blocks: int, block: int, pull: int, trees: list[Path]) -> None:
    run_dir = Path(tempfile.mkdtemp())
    procs, raws, calls, k = {}, {}, {}, {}
    out = {t.name: [] for t in trees}
    grad = torch.full((P,), 1e-3)
    try:
        for t in trees:
            procs[t.name] = start_shard(0, run_dir / f"{t.name}.log", env={"PYTHONPATH": str(t)},
                                        prefix=["env", "-C", str(t)])
            raw = raws[t.name] = RawShard(SimpleNamespace(address=procs[t.name].address))
            raw.register(spec=job(num_embeddings=1 << 20))
            raw.init(torch.zeros(P), chunk_bytes=1 << 20)
            calls[t.name], k[t.name] = raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step), 0

        def step(name):
            k[name] += 1
            n, raw = k[name], raws[name]
            h = raw.header(sequence=n, version=n - 1)
            msgs = [StepMessage(0, dense=c) for c in encode(wire_tensor(grad, h.dtype), h, 1 << 20)] + rows(
                1, rows_chunks(list(range(16)), seq=n, base=n - 1), list(range(n % 1000, n % 1000 + pull)))
            calls[name](one_message(msgs), timeout=30)

        names = list(out)
        for _ in range(200):
            for name in names:
                step(name)
        for b in range(blocks * len(names)):
            name = names[(b + b // len(names)) % len(names)]
            pid = procs[name].popen.pid
            s0, c0, w0 = sample(pid)["cpu"], _cpu(), time.perf_counter()
            for _ in range(block):
                step(name)
            line = {"tree": name, "shard_us": 1e6 * (sample(pid)["cpu"] - s0) / block,
                    "client_us": 1e6 * (_cpu() - c0) / block, "wall_us": 1e6 * (time.perf_counter() - w0) / block,
                    "load_average": os.getloadavg()[0]}
            out[name].append(line)
            print(json.dumps({m: round(v, 1) if isinstance(v, float) else v for m, v in line.items()}), flush=True)
    finally:
        for raw in raws.values():
            raw.close()
        for p in procs.values():
            p.terminate()
    print(json.dumps({"pull": pull, "block": block, "medians": {
        w: {m: round(statistics.median(x[m] for x in v), 1) for m in ("shard_us", "client_us", "wall_us")}
        for w, v in out.items()}}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [Path(t).resolve() for t in sys.argv[4:]])
