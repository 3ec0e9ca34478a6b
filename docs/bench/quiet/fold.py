"""Interleaved pairs: an async table's next batch riding on the Step (fold_async, the default) against pulled in the
background at the announce; the click model, 2 shards, 1 trainer, sync dense + async tables.

    PYTHONPATH=$PWD python docs/bench/quiet/fold.py STEPS BATCH ROUNDS
"""
import json, os, sys, tempfile
from pathlib import Path
import torch
from trainer.workloads.recdata import make_click_log
from trainer.tools import sparsebench
from trainer.stepping import step_call
torch.set_num_threads(1)
steps, batch, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
orig = step_call.StepCall.usable
FOLD = {"v": True}
def usable(self, variants_off):
    u = orig(self, variants_off)
    r = self._rows()
    if r is not None and not FOLD["v"]:
        r.ahead.fold_async = False
    return u
step_call.StepCall.usable = usable
log = make_click_log(steps * batch, seed=0).compact()
one = sparsebench.single_process_rate(log, steps, batch, 16, lr=0.05)
for r in range(rounds):
    for fold in ((True, False) if r % 2 == 0 else (False, True)):
        FOLD["v"] = fold
        res = sparsebench.sharded_rate(log, steps, batch, 16, 0.05, 2, Path(tempfile.mkdtemp()),
                                       embedding_mode="async", prefetch=True, one_call=True)
        print(json.dumps({"fold": fold, "batch": batch, "steps_per_s": round(steps / res["seconds"], 2),
              "ratio": round(one["seconds"] / res["seconds"], 3), "trips": res["round_trips_per_step"],
              "load": os.getloadavg()[0]}), flush=True)
