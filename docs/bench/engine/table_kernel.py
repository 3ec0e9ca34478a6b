"""A click table's lookup and push per batch on the C table kernel and on numpy's (psserver.protocol.rows.kernel),
in one process: two tables fed the same batches, the kernel switched per block, blocks rotated so a loaded
machine's drift falls on both.  Batches are the click log's (bags of 1..8 Zipf ids over 10^9, 512 samples: ~1,340
unique ids, ~60% of them new rows), dim 16, Adagrad rows -- shard_ab.py's table.  The two tables' states are
compared at the end: the kernels must agree bit for bit.

    PYTHONPATH=$PWD python docs/bench/engine/table_kernel.py [BLOCKS [BLOCK]]
"""
import json
import statistics
import sys
import time

import torch

from psserver.protocol.rows import kernel
from psserver.protocol.rows.table import RowStore

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import shard_ab  # noqa: E402  (the same table and batches)


def main(blocks: int, block: int) -> None:
    if kernel.native is None:
        sys.exit("the C table kernel is not built here (pip install -e . with a compiler): nothing to compare")
    native, spec = kernel.native, shard_ab.spec().tables[0]
    ids = shard_ab.batches(2 * blocks * block + 200)
    stores = {"c": RowStore(spec), "numpy": RowStore(spec)}
    grads = [torch.full((len(b), spec.dim), 1e-3) for b in ids]
    at = {"c": 0, "numpy": 0}

    def run(way: str, n: int) -> float:
        kernel.native = native if way == "c" else None
        store, cpu = stores[way], 0.0
        for _ in range(n):
            k = at[way]
            start = time.process_time()
            store.lookup(ids[k])
            store.apply(ids[k], grads[k])
            cpu += time.process_time() - start
            at[way] += 1
        kernel.native = native
        return 1e6 * cpu / n

    for way in stores:  # the first batches (allocations grown), untimed
        run(way, 100)
    out = {"c": [], "numpy": []}
    for b in range(2 * blocks):
        way = ("c", "numpy")[(b + b // 2) % 2]
        out[way].append(run(way, block))
        print(json.dumps({"way": way, "cpu_us_per_batch": round(out[way][-1], 1)}), flush=True)
    a, b = stores["c"].state(), stores["numpy"].state()
    same = all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    med = {w: round(statistics.median(v), 1) for w, v in out.items()}
    print(json.dumps({"unique_ids_per_batch": round(statistics.mean(len(i) for i in ids)), "rows": len(stores["c"]),
                      "median_cpu_us_per_batch": med, "c_over_numpy": round(med["c"] / med["numpy"], 3),
                      "states_equal": same}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
