"""Microseconds of ids once's per-call work on one thread, the tree on PYTHONPATH: pack (trainer), unpack
(shard), the trainer naming its pull (RefBook.name), the shard resolving a push naming one pull whole, and the
placement hash of a push's id check (what a push trusted as checked skips).  Realistic sets: ~700 unique ids a
table a shard (the click model at batch 512), raw Zipf ids over 10^9 and renumbered 0..u-1.  Median of REPEATS
runs of 300 calls each (the machine is shared: medians, not minima of one run).

    PYTHONPATH=$PWD python docs/bench/idsonce/micro.py [REPEATS]
"""
import json
import statistics
import sys
import timeit

import numpy as np
import torch

from psserver.protocol.rows import idpack
from psserver.protocol.rows.placement import shard_of
from psserver.sparse.pull_refs import PullRefs
from trainer.tables.pull_refs import RefBook

torch.set_num_threads(1)
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
rng = np.random.default_rng(0)
for label, values in (("raw_1e9", rng.integers(0, 10**9, 760)), ("renumbered", rng.integers(0, 900, 2000))):
    ids = torch.from_numpy(np.unique(values)[:700])
    packed, owner = idpack.pack(ids), ("f", 0, "t", "emb")
    book, refs = RefBook(), PullRefs()
    book.record(1, ids.clone())
    ref = refs.keep(owner, ids)
    ops = {"pack": lambda: idpack.pack(ids), "unpack": lambda: idpack.unpack(packed, 1 << 20),
           "packable": lambda: idpack.packable(ids), "name": lambda: book.name(ids),
           "resolve": lambda: refs.resolve(owner, [ref], ids[:0], len(ids)), "placement_hash": lambda: shard_of(ids, 2)}
    times = {op: [] for op in ops}
    for _ in range(repeats):
        for op, f in ops.items():
            times[op].append(timeit.timeit(f, number=300) / 300 * 1e6)
    print(json.dumps({"ids": label, "n": len(ids), "packed_bytes": len(packed),
                      **{f"{op}_us": round(statistics.median(v), 1) for op, v in times.items()}}))
