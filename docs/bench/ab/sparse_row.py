"""The click model's bag on one shard (sync, Adagrad rows), one trainer: lookups+updates per second, from the
code on PYTHONPATH (ps-bench's sparse row)."""
import os, tempfile
from pathlib import Path
if os.path.isdir(os.path.join(os.environ["PYTHONPATH"], "trainer", "tools")):
    from trainer.tools import sparsebench
else:
    from trainer import sparsebench
from trainer.workloads.recdata import make_click_log
steps, batch = 60, 512
log = make_click_log(steps * batch, seed=0).compact()
r = sparsebench.sharded_rate(log, steps, batch, 16, 0.05, 1, Path(tempfile.mkdtemp()))
print(f"{r['ids_per_s']:.0f}")
