"""One run for the table push window of docs/bench/sparse-tables.md (issue 21 item 5): the click model (batch 512, dim 16, Adagrad
rows) in one process, then on 2 local ps-server shards with 1 trainer, sync dense head and async embeddings,
the tables' pushes with a window of W in flight (1: each acknowledged before the next step); prints one JSON
line with both rates, their ratio and the 1-minute load average at the end.

    PYTHONPATH=$PWD python docs/bench/table-window/run.py W [STEPS]
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
window = int(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 150
batch, dim = 512, 16
log = make_click_log(steps * batch, seed=0).compact()
one = sparsebench.single_process_rate(log, steps, batch, dim, lr=0.05)
r = sparsebench.sharded_rate(log, steps, batch, dim, 0.05, 2, Path(tempfile.mkdtemp()), embedding_mode="async",
                             push_window=window)
print(json.dumps({"push_window": window, "steps": steps, "one_steps_per_s": steps / one["seconds"],
                  "steps_per_s": steps / r["seconds"], "ratio": one["seconds"] / r["seconds"],
                  "bytes_per_step": r["bytes_per_step"], "round_trips_per_step": r["round_trips_per_step"],
                  "load1": os.getloadavg()[0]}))
