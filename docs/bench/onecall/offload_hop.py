"""The hop to the state worker and back that a Step's table work takes once a table outgrew the loop's bound
(psserver.serving.runtime.Runtime.offload; issue 21, stepspeed2): ``run_in_executor`` (before) against a plain future
answered with one ``call_soon_threadsafe`` (after, as Runtime.run_state hands a result back), on one event loop and
a one-thread executor as the shard has them.  Blocks of BLOCK hops alternate between the two, so a loaded
machine's drift falls on both; the process's CPU (both threads) and the wall time per hop, microseconds; one JSON
line a block, then one of medians.

    PYTHONPATH=$PWD python docs/bench/onecall/offload_hop.py [BLOCKS_EACH [BLOCK]]
"""
import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from psserver.serving.runtime import _deliver


def _work():
    return 1


def main(blocks: int, block: int) -> None:
    loop = asyncio.new_event_loop()
    state = ThreadPoolExecutor(1)

    def on_worker(fut, fn):
        loop.call_soon_threadsafe(_deliver, fut, fn(), None)

    def before():
        return loop.run_in_executor(state, _work)

    def after():
        fut = loop.create_future()
        state.submit(on_worker, fut, _work)
        return fut

    async def hops(way, n):
        for _ in range(n):
            await way()

    ways = {"run_in_executor": before, "call_soon_threadsafe": after}
    loop.run_until_complete(hops(after, 200))
    out = {w: [] for w in ways}
    for k in range(2 * blocks):
        name = list(ways)[(k + k // 2) % 2]
        c0, w0 = time.process_time(), time.perf_counter()
        loop.run_until_complete(hops(ways[name], block))
        line = {"way": name, "cpu_us": 1e6 * (time.process_time() - c0) / block,
                "wall_us": 1e6 * (time.perf_counter() - w0) / block, "load_average": os.getloadavg()[0]}
        out[name].append(line)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
    print(json.dumps({"medians": {w: {m: round(statistics.median(x[m] for x in v), 2) for m in ("cpu_us", "wall_us")}
                                  for w, v in out.items()}}))
    state.shutdown()
    loop.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10, int(sys.argv[2]) if len(sys.argv) > 2 else 2000)
