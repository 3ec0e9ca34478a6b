"""One interleaved pair for docs/bench/sparse.md (issue 21 item 1, the Step call): the click model (batch 512, dim 16,
Adagrad rows) in one process, then on 2 local ps-server shards with 1 trainer in MODE ("sync": everything sync;
"async": sync dense head, async embeddings), with ``ps.prefetching`` on, ONE_CALL 1 (a shard's dense slice and
table in one Step call) or 0 (PushPull and PushPullRows side by side: main before this change); one JSON line.

    PYTHONPATH=$PWD python docs/bench/onecall/run.py MODE ONE_CALL(0|1) [STEPS [BATCH]]   # BATCH: 512 by default
"""
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from trainer.workloads.recdata import make_click_log
from trainer.tools import sparsebench

torch.set_num_threads(1)
mode, one_call = sys.argv[1], sys.argv[2] == "1"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 150
batch, dim = int(sys.argv[4]) if len(sys.argv) > 4 else 512, 16
log = make_click_log(steps * batch, seed=0).compact()
one = sparsebench.single_process_rate(log, steps, batch, dim, lr=0.05)
r = sparsebench.sharded_rate(log, steps, batch, dim, 0.05, 2, Path(tempfile.mkdtemp()),
                             embedding_mode="async" if mode == "async" else "", prefetch=True, one_call=one_call)
print(json.dumps({"mode": mode, "one_call": one_call, "batch": batch, "one_steps_per_s": steps / one["seconds"],
                  "steps_per_s": steps / r["seconds"], "ratio": one["seconds"] / r["seconds"],
                  "round_trips_per_step": r["round_trips_per_step"], "bytes_per_step": r["bytes_per_step"],
                  "prefetch_hit_rate": r["prefetch_hit_rate"], "load_average": os.getloadavg()[0]}))
