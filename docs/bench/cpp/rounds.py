"""Interleaved rounds of the comparison: for each configuration, every system in turn, the order rotated each
round; one JSON line per run (with the load average before and after) appended to results.jsonl.

    python3 docs/bench/cpp/rounds.py --rounds 3 [--out docs/bench/cpp/results.jsonl]

Runs the three harnesses with their own interpreters (psgrpc: .venv; Paddle and TF: /work/cpp-venvs/*), each as
a child process group that is ended on every way out.  Then ``python3 docs/bench/cpp/summarize.py`` makes the tables.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = common.HERE.parents[2]
PY = {"psgrpc": str(REPO / ".venv/bin/python"), "paddle": "/work/cpp-venvs/paddle/bin/python",
      "tf": "/work/cpp-venvs/tf/bin/python"}
SCRIPT = {"psgrpc": "psgrpc_ps.py", "paddle": "paddle_ps.py", "tf": "tf_ps.py"}
CONFIGS = [("click", 1), ("click", 2), ("mlp", 2)]
SYSTEMS = [("psgrpc", "W1", ["--push-window", "1"]), ("psgrpc", "W4", ["--push-window", "4"]),
           ("paddle", "pull-each-step", ["--dense-pull", "step"]), ("tf", "", []),
           ("paddle", "as-is (no dense pull)", ["--dense-pull", "none"])]


def run_one(system, extra, workload, workers, steps, warmup, timeout):
    cmd = [PY[system], str(common.HERE / SCRIPT[system]), "--workload", workload, "--servers", "2",
           "--workers", str(workers), "--steps", str(steps), "--warmup", str(warmup)] + extra
    env = dict(os.environ, PYTHONPATH=str(REPO), FLAGS_enable_pir_api="0", TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        common.kill_group(p)
        return None, "timeout"
    finally:
        common.kill_group(p)  # the launcher has ended its own children; this is for a launcher that did not
    rows = [json.loads(l) for l in out.decode().splitlines() if l.startswith("{")]
    if p.returncode != 0 or not rows:
        return None, f"exit {p.returncode}: {err.decode()[-800:]}"
    return rows, ""


def main():
    common.exit_on_sigterm()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=330)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--out", default=str(common.HERE / "results.jsonl"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--first-round", type=int, default=0)
    a = ap.parse_args()
    for rnd in range(a.first_round, a.first_round + a.rounds):
        for workload, workers in CONFIGS:
            order = SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]
            if workload == "click" and workers == 1:
                order = order + [("psgrpc", "one process", ["--single"])]
            for pos, (system, variant, extra) in enumerate(order):
                load_before = os.getloadavg()
                t = time.time()
                rows, error = run_one(system, extra, workload, workers, a.steps, a.warmup, a.timeout)
                rec = {"round": rnd, "position": pos, "system": system, "variant": variant, "workload": workload,
                       "servers": 0 if variant == "one process" else 2, "workers": workers, "steps": a.steps,
                       "warmup": a.warmup, "wall_s": time.time() - t, "load_before": load_before}
                if rows is None:
                    rec["error"] = error
                else:
                    if system == "tf":
                        per_worker = [rows[0]["steps_per_s"]] * workers
                        total = rows[0]["total_steps_per_s"]
                    else:
                        per_worker = [r["steps_per_s"] for r in rows]  # the launcher prints one line per worker
                        total = sum(per_worker)
                    rec.update(per_worker_steps_per_s=per_worker, steps_per_s=total / len(per_worker),
                               total_steps_per_s=total, samples_per_s=total * common.BATCH[workload],
                               losses=[r.get("losses") for r in rows])
                rec = common.record(a.out, rec)
                common.log(rnd, workload, workers, system, variant, rec.get("steps_per_s"), rec.get("error", ""),
                           rec["load"])


if __name__ == "__main__":
    main()
