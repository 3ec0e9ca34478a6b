"""One interleaved pair for docs/bench/sparse.md (issue 21): the click model (batch 512, dim 16, Adagrad rows) in
one process, then on 2 local ps-server shards with 1 trainer in MODE ("sync": everything sync; "async": sync dense
head, async embeddings), with or without ``ps.prefetching``; prints one JSON line with both rates and the ratio.

    PYTHONPATH=$PWD python docs/bench/prefetch/run.py MODE PREFETCH(0|1) [STEPS]
"""
import json
import sys
import tempfile
from pathlib import Path

import torch

from trainer.workloads.recdata import make_click_log
from trainer.tools import sparsebench

torch.set_num_threads(1)
mode, prefetch = sys.argv[1], sys.argv[2] == "1"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 150
batch, dim = 512, 16
log = make_click_log(steps * batch, seed=0).compact()
one = sparsebench.single_process_rate(log, steps, batch, dim, lr=0.05)
r = sparsebench.sharded_rate(log, steps, batch, dim, 0.05, 2, Path(tempfile.mkdtemp()),
                             embedding_mode="async" if mode == "async" else "", prefetch=prefetch)
print(json.dumps({"mode": mode, "prefetch": prefetch, "one_steps_per_s": steps / one["seconds"],
                  "steps_per_s": steps / r["seconds"], "ratio": one["seconds"] / r["seconds"],
                  "bytes_per_step": r["bytes_per_step"], "row_bytes_per_step": r["row_bytes_per_step"],
                  "prefetch_hit_rate": r["prefetch_hit_rate"]}))
