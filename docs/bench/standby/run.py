"""The hot standby's cost and failover time, measured with ps-cluster as a user runs it (docs/standby.md).

    PYTHONPATH=$PWD python docs/bench/standby/run.py [--model cnn] [--rounds 3] [--steps 150] [--out results.jsonl]

Interleaves runs without and with ``--standbys 1`` (same job, same machine; each pair back to back, so load drifts
hit both), then runs ``--kill-primary 0@STEPS/3`` and reports how long shard 0 took to go on.  One line of JSON a
run; a summary at the end.  On one host every standby shares the CPUs with the primaries and trainers: the cost
measured here is an upper bound of a cluster's, where a standby runs on another machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def cluster(args, standbys: int, extra: list[str]) -> dict:
    run = Path(tempfile.mkdtemp(prefix="standby-bench-"))
    cmd = [sys.executable, "-c", "from trainer.local.cluster import entrypoint; entrypoint()", "--standbys", str(standbys),
           "--steps", str(args.steps), "--model", args.model, "--dataset", args.dataset, "--run-dir", str(run),
           *extra]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1200)
    s = json.loads((run / "summary.json").read_text())
    return dict(model=args.model, standbys=standbys, extra=extra, samples_per_sec=s["samples_per_sec"],
                rounds=s["rounds"], replication=s.get("replication"), failovers=s.get("failovers"),
                steps_lost=s["steps_lost"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="mnist5k")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    for _ in range(args.rounds):
        for standbys in (0, 1):
            rows.append(cluster(args, standbys, []))
            print(json.dumps(rows[-1]), flush=True)
    for _ in range(args.rounds):
        rows.append(cluster(args, 1, ["--kill-primary", f"0@{args.steps // 3}"]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    plain = [r["samples_per_sec"] for r in rows if r["standbys"] == 0]
    replicated = [r["samples_per_sec"] for r in rows if r["standbys"] == 1 and not r["extra"]]
    ships = [r for r in rows if r["standbys"] == 1 and not r["extra"]]
    seconds = [f["seconds"] for r in rows if r["extra"] for f in r["failovers"]]
    print(json.dumps(dict(
        model=args.model, samples_per_sec_plain=statistics.median(plain),
        samples_per_sec_standby=statistics.median(replicated),
        ratio=statistics.median(replicated) / statistics.median(plain),
        shipments_per_round_per_shard=statistics.median(r["replication"]["shipments"] / (2 * r["rounds"]) for r in ships),
        bytes_per_shipment=statistics.median(r["replication"]["bytes"] / r["replication"]["shipments"] for r in ships),
        failover_seconds=seconds, steps_lost=[r["steps_lost"] for r in rows if r["extra"]])), flush=True)


if __name__ == "__main__":
    main()
