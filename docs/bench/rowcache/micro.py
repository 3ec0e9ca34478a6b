"""The row cache's own cost per step (issue 21 item 3), no network: ``RowCache`` alone, one torch thread, fed
the click log's batches (batch 512, ~1,330 unique ids a step): a lookup, an insert of the misses (as
``pull_through`` does after its fetch), then every id ``pushed``: what a training step asks of it.  Prints one
JSON line of median microseconds of this thread's CPU time (steadier than wall time on a loaded machine) per
step of lookup, insert, pushed (drop) and the whole step, after the cache has filled.

    PYTHONPATH=$PWD python docs/bench/rowcache/micro.py [CACHE_ROWS] [STALENESS] [STEPS]
"""
import json
import statistics
import sys
import time

import torch

from trainer.workloads.recdata import make_click_log
from trainer.tables.row_cache import RowCache

torch.set_num_threads(1)
capacity = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
bound = int(sys.argv[2]) if len(sys.argv) > 2 else 4
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
batch, dim, shards = 512, 16, 2
log = make_click_log(steps * batch, seed=0)
cache = RowCache(capacity, dim, max_staleness=bound)
times = {"lookup": [], "insert": [], "pushed": [], "step": []}
for step in range(steps):
    ids = torch.unique(log.take(torch.arange(step * batch, (step + 1) * batch)).ids)
    known = torch.full((shards,), step, dtype=torch.int64)
    t0 = time.thread_time()
    look = cache.lookup(ids, known)
    t1 = time.thread_time()
    miss = ~look.hit
    n = int(miss.sum())
    cache.insert(ids[miss], torch.zeros(n, dim), torch.full((n,), step, dtype=torch.int64), ids[miss] % shards)
    t2 = time.thread_time()
    cache.pushed(ids)
    t3 = time.thread_time()
    if step >= steps // 3:  # filled (100,000 rows take ~75 steps of new ids here)
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            times[k].append(v * 1e6)
print(json.dumps({"cache_rows": capacity, "staleness": bound, "held": len(cache),
                  **{f"{k}_us": round(statistics.median(v), 1) for k, v in times.items()},
                  "hits": cache.counts["hits"], "evicted": cache.counts["evicted"]}))
