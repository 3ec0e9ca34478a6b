"""Row bytes a step against unique ids x dim x 4 x 2 (issue 21 item 4), from the row client's own counters.

    PYTHONPATH=$PWD .venv/bin/python docs/bench/idsonce/bytes.py [STEPS] [BATCH] [SHARDS] [COMPACT]

One line of JSON per configuration: the click model (Zipf ids over 10^9, dim 16, Adagrad rows) through
``trainer.tools.sparsebench.sharded_rate`` -- full sync without prefetch (what ``ps-bench --sections sparse``
runs), full sync with prefetch (the Step call), sync dense + async tables with prefetch.  COMPACT 1 (default):
the log's ids renumbered densely, as ``ps-bench --sections sparse`` does; 0: the raw ids over 10^9, as the sparse
grid's sharded runs use.  Bytes only: the rates
of so short a run on a shared machine mean nothing.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from trainer.workloads.recdata import make_click_log
from trainer.tools import sparsebench


def main(steps: int = 40, batch: int = 512, shards: int = 2, compact: int = 1) -> None:
    torch.set_num_threads(1)
    log = make_click_log(steps * batch, seed=0)
    log = log.compact() if compact else log
    with tempfile.TemporaryDirectory() as d:
        for name, kw in (("sync", {}), ("sync+prefetch", {"prefetch": True}),
                         ("async-tables+prefetch", {"prefetch": True, "embedding_mode": "async"})):
            r = sparsebench.sharded_rate(log, steps, batch, 16, 0.05, shards, Path(d) / name, **kw)
            print(json.dumps({"config": name, "steps": steps, "batch": batch, "shards": shards, "compact": compact,
                              "bytes_per_step": round(r["bytes_per_step"], 1),
                              "unique_x_dim_x_4_x_2": round(r["row_bytes_per_step"], 1),
                              "ratio": round(r["bytes_per_step"] / r["row_bytes_per_step"], 4),
                              "round_trips_per_step": round(r["round_trips_per_step"], 2),
                              "pushes_naming_pulls": r.get("pushes_naming_pulls"),
                              "pull_refs_refused": r.get("pull_refs_refused")}), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
