"""One run for docs/row-cache.md (issue 21 item 3): the click model (batch 512, dim 16, Adagrad rows) in one
process, then on 2 local ps-server shards with 1 trainer in MODE ("sync": everything sync; "async": sync dense
head, async embeddings), the bag with a worker-side row cache of CACHE_ROWS rows and bound STALENESS (0 rows: no
cache); prints one JSON line: bytes per step and hit rate (load-independent), steps/s (noisy).

    PYTHONPATH=$PWD python docs/bench/rowcache/run.py MODE CACHE_ROWS STALENESS [STEPS]
"""
import json
import sys
import tempfile
from pathlib import Path

import torch

from trainer.workloads.recdata import make_click_log
from trainer.tools import sparsebench

torch.set_num_threads(1)
mode, cache_rows, staleness = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 150
batch, dim = 512, 16
log = make_click_log(steps * batch, seed=0).compact()
one = sparsebench.single_process_rate(log, steps, batch, dim, lr=0.05)
r = sparsebench.sharded_rate(log, steps, batch, dim, 0.05, 2, Path(tempfile.mkdtemp()),
                             embedding_mode="async" if mode == "async" else "", cache_rows=cache_rows,
                             cache_staleness=staleness)
print(json.dumps({"mode": mode, "cache_rows": cache_rows, "cache_staleness": staleness, "steps": steps,
                  "one_steps_per_s": steps / one["seconds"], "steps_per_s": steps / r["seconds"],
                  "ratio": one["seconds"] / r["seconds"], "bytes_per_step": r["bytes_per_step"],
                  "row_bytes_per_step": r["row_bytes_per_step"], "cache_hit_rate": r["cache_hit_rate"],
                  **r["cache_counts"]}))
