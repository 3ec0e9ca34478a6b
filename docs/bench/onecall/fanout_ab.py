"""Two shards' unary calls from one trainer step (issue 21, stepspeed2, candidate b): "pool" -- shard 1's call on a
pool thread, shard 0's on the caller's, as trainer.channels.client.map_settled runs them -- against "futures" -- shard 1's
issued as a gRPC future, shard 0's blocking on the caller's thread, then shard 1's result (trainer.stepping.step_call's
one_thread).  The calls are GetStats to two real ps-server processes (a small unary call; what a Step adds on the
shard is the same either way).  Blocks of BLOCK pairs alternate, so a loaded machine's drift falls on both; this
process's CPU (all its threads) and the wall time a pair, microseconds; one JSON line a block, then medians.
Two more ways (issue 21, trainerlean, candidate b): "aio" -- both calls on grpc.aio channels, gathered on one
event-loop thread of their own that the caller hands the pair to (asyncio.run_coroutine_threadsafe) and waits on --
and "aioself" -- the same gathered on an event loop the caller's thread runs itself (run_until_complete: no hop
to another Python thread; gRPC's own poller thread still wakes the loop).

    PYTHONPATH=$PWD python docs/bench/onecall/fanout_ab.py [BLOCKS_EACH [BLOCK [WAYS]]]   # WAYS: pool,futures
"""
import asyncio
import json
import os
import threading
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
from trainer.local.procs import start_shard


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Aio:
    """grpc.aio stubs of ``addresses`` on ``loop`` (created on it), and the pair of calls gathered there."""

    def __init__(self, addresses: list[str], loop: asyncio.AbstractEventLoop):
        self.loop = loop

        async def make():
            chans = [grpc.aio.insecure_channel(a) for a in addresses]
            return chans, [c.unary_unary(method("GetStats"), pb.StatsRequest.SerializeToString,
                                         pb.StatsReply.FromString) for c in chans]
        self.channels, self.calls = self._run(make())

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    async def pair(self, req):
        return await asyncio.gather(*(c(req, timeout=30) for c in self.calls))

    def close(self):
        async def close_all():
            await asyncio.gather(*(c.close() for c in self.channels))
        self._run(close_all())


class _AioThread(_Aio):
    """The same on a loop run by a thread of its own: the caller hands each pair over and waits."""

    def __init__(self, addresses: list[str]):
        loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=loop.run_forever, daemon=True)
        self.thread.start()
        super().__init__(addresses, loop)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self):
        super().close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def main(blocks: int, block: int, names: list[str]) -> None:
    run_dir = Path(tempfile.mkdtemp())
    procs = [start_shard(i, run_dir / f"shard{i}.log") for i in range(2)]
    try:
        _measure(procs, blocks, block, names)
    finally:
        for p in procs:
            p.terminate()


def _measure(procs, blocks: int, block: int, names: list[str]) -> None:
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

    aio = _AioThread([p.address for p in procs])
    own = _Aio([p.address for p in procs], asyncio.new_event_loop())
    every = {"pool": pooled, "futures": futures, "aio": lambda: aio._run(aio.pair(req)),
             "aioself": lambda: own._run(own.pair(req))}
    ways = {w: every[w] for w in names}
    out = {w: [] for w in ways}
    try:
        for _ in range(200):
            for w in ways.values():
                w()
        n = len(ways)
        for k in range(n * blocks):
            name = list(ways)[(k + k // n) % n]
            c0, w0 = _cpu(), time.perf_counter()
            for _ in range(block):
                ways[name]()
            line = {"way": name, "cpu_us": 1e6 * (_cpu() - c0) / block, "wall_us": 1e6 * (time.perf_counter() - w0) / block,
                    "load_average": os.getloadavg()[0]}
            out[name].append(line)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
    finally:
        aio.close()
        own.close()
        for c in channels:
            c.close()
        pool.shutdown()
    print(json.dumps({"medians": {w: {m: round(statistics.median(x[m] for x in v), 1) for m in ("cpu_us", "wall_us")}
                                  for w, v in out.items()}}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, int(sys.argv[2]) if len(sys.argv) > 2 else 500,
         sys.argv[3].split(",") if len(sys.argv) > 3 else ["pool", "futures"])
