"""The id index's find + insert of a pull's ~2,048 ids (~1,220 new), two probe passes (find, then insert) against one
(find_with_room, then insert at the room), in one process on the same batches, alternating (issue 21 item 2).

    PYTHONPATH=$PWD python docs/bench/onecall/index_ab.py
"""
import copy
import statistics
import time

import numpy as np
import torch

from psserver.protocol.rows.index import IdIndex

torch.set_num_threads(1)
rng = np.random.default_rng(0)
a = IdIndex()
base = torch.unique(torch.from_numpy(rng.integers(0, 10**12, 300_000)))
a.insert(base, torch.arange(len(base)))
b = copy.deepcopy(a)
ta, tb, nxt = [], [], 10**9
for k in range(400):
    ids = torch.unique(torch.cat([base[rng.integers(0, len(base), 830)], torch.from_numpy(rng.integers(0, 10**12, 1220))]))
    for which in ((0, 1) if k % 2 else (1, 0)):
        t0 = time.thread_time()
        if which == 0:
            s = a.find(ids); m = (s < 0).nonzero().flatten(); a.insert(ids[m], torch.arange(nxt, nxt + len(m)))
            ta.append(time.thread_time() - t0)
        else:
            s, room = b.find_with_room(ids); m = (s < 0).nonzero().flatten(); b.insert(ids[m], torch.arange(nxt, nxt + len(m)), room.of(m))
            tb.append(time.thread_time() - t0)
    nxt += len(m)
assert torch.equal(a.find(ids), b.find(ids))
fa, fb = statistics.median(ta[50:]), statistics.median(tb[50:])
# a find of present ids only (a push): find vs find_with_room
pa, pb = [], []
for k in range(300):
    ids = torch.unique(base[rng.integers(0, len(base), 2048)])
    t0 = time.thread_time(); a.find(ids); pa.append(time.thread_time() - t0)
    t0 = time.thread_time(); b.find_with_room(ids); pb.append(time.thread_time() - t0)
print(f"find+insert of ~2,048 ids (~1,220 new): two passes {1e3*fa:.3f} ms, one pass {1e3*fb:.3f} ms (CPU medians); "
      f"find of 2,048 present ids: find {1e3*statistics.median(pa):.3f} ms, find_with_room {1e3*statistics.median(pb):.3f} ms")
