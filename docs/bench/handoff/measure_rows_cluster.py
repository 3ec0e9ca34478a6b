"""Ad hoc (not ps-bench yet): a DLRM job on criteo-synth with ~1,000,000 live rows (26 tables of dim 16, Adagrad) moved
live 2 -> 3 by `ps-cluster --reshard 3@AT` under two real ps-trainer processes (docs/handoff-io.md, "Tables with
real trainers: measured").

criteo-synth's training log is 131,072 samples (~404,000 distinct ids over its 26 tables): too few rows.  The
trainers here generate a longer log of the same stream (N_TRAIN samples, default 524,288: ~1,000,000 distinct ids in
its first 409,600), through one patched line in their start command (``load_criteo_dataset``'s ``n_train``; no
flag exists for it).  Everything else is ps-cluster as a user runs it, in this process.

Run: PYTHONPATH=$PWD python docs/bench/handoff/measure_rows_cluster.py [AT] [STEPS] [N_TRAIN]
Prints the summary's hand-off (R, seconds, bytes, rates), the coordinator's DECIDE block, the live rows per shard at
the end, and rank 0's round times: the median before PREPARE, the rounds between PREPARE and the switch, and the
slowest round there (the dip).
"""
import json, logging, re, statistics, sys, threading, time
from pathlib import Path

from psserver.protocol.stubs import fetch_stat
from trainer.local import cluster
from trainer.local import procs

AT = int(sys.argv[1]) if len(sys.argv) > 1 else 215
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
N_TRAIN = int(sys.argv[3]) if len(sys.argv) > 3 else 524_288
RUN = Path(f"/tmp/measure_rows_cluster-{int(time.time())}")

_cli = procs.cli


def cli(module: str) -> list[str]:
    """ps-trainer with a longer criteo-synth log; every other command as ps-cluster starts it."""
    if module != "trainer.running.cli":
        return _cli(module)
    return [sys.executable, "-c", "import functools, trainer.workloads.rectrain as r; r.load_criteo_dataset = functools.partial("
            f"r.load_criteo_dataset, n_train={N_TRAIN}); from trainer.running.cli import entrypoint; entrypoint()"]


class Seen(logging.Handler):
    """ps-cluster's coordinator lines with the time each was logged (PREPARE and the switch)."""

    def __init__(self):
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record):
        self.lines.append((record.created, record.getMessage()))


KEEP = ("handoff_row_recopies", "handoff_recopies", "handoff_rounds_throttled", "handoff_replies_held",
        "handoff_reply_holds_expired", "handoff_stream_retries", "handoff_row_bytes_sent", "lease_expired",
        "rejoins", "steps")
last: dict[str, dict] = {}  # each old shard's handoff counters, polled while the job runs (the old layout's host)


def poll() -> None:
    """Each shard's hand-off counters, read every second until the switch (after it GetStats shows layout 1's)."""
    while not any("reshard: switched" in m for _, m in seen.lines):
        for _, m in list(seen.lines):
            up = re.match(r"(shard\d) up at (\S+)", m)
            if up:
                try:
                    c = fetch_stat(up.group(2)).counters
                    last[up.group(1)] = {k: int(v) for k, v in c.items() if k in KEEP or "silent" in k or "expired" in k}
                except Exception:  # noqa: BLE001 -- a busy or stopping shard: keep the last read
                    pass
        time.sleep(1.0)


procs.cli = cli
seen = Seen()
logging.getLogger("ps-cluster").addHandler(seen)
threading.Thread(target=poll, daemon=True).start()
argv = ["--shards", "2", "--trainers", "2", "--reshard", f"3@{AT}", "--steps", str(STEPS), "--model", "dlrm",
        "--dataset", "criteo-synth", "--sparse-optimizer", "adagrad", "--sparse-lr", "0.05", "--device", "cpu",
        "--eval-every", "100000", "--run-dir", str(RUN)]
print("ps-cluster", " ".join(argv), f"(trainers' criteo-synth log: {N_TRAIN} samples)", flush=True)
rc = cluster.main(argv)
summary = json.loads((RUN / "summary.json").read_text())
[h] = summary["reshard"]
lines = (RUN / "reshard.log").read_text()
block = re.search(r"switched \(block ([\d.]+) s\)", lines)
prepared = next(t for t, m in seen.lines if "reshard: prepared" in m)
switched = next(t for t, m in seen.lines if "reshard: switched" in m)
records = [json.loads(l) for l in (RUN / "trainer0.jsonl").read_text().splitlines() if l.startswith("{")]
ends = sorted((r["versions"][0], r["time"]) for r in records if r.get("event") == "step" and r.get("versions"))
rounds = [(v, t - t0) for (v, t), (_, t0) in zip(ends[1:], ends)]  # (version, seconds the round took for rank 0)
before = [d for (v, d), (_, t) in zip(rounds, ends[1:]) if t < prepared][-30:]
during = [(v, d) for (v, d), (_, t) in zip(rounds, ends[1:]) if prepared <= t <= switched + 0.5]
after = [d for (v, d) in rounds if v > h["round"] + 5][:30]
print(json.dumps(dict(rc=rc, exit_codes=summary["exit_codes"], R=h["round"], handoff_seconds=h["handoff_seconds"],
                      block_seconds=float(block.group(1)) if block else None, bytes_moved=h["bytes_moved"],
                      steps_per_sec_before=h["steps_per_sec_before"], steps_per_sec_after=h["steps_per_sec_after"],
                      rows_per_shard=h.get("shard_table_rows") and [sum(r.values()) for r in h["shard_table_rows"]],
                      table_versions=h.get("shard_table_versions") and
                      [sorted(set(v.values())) for v in h["shard_table_versions"]],
                      round_median_before_ms=before and round(1000 * statistics.median(before)),
                      round_median_after_ms=after and round(1000 * statistics.median(after)),
                      rounds_during=len(during), round_max_during_ms=during and round(1000 * max(d for _, d in during)),
                      prepare_to_switch_s=round(switched - prepared, 2), counters_before_switch=last,
                      run=str(RUN)), indent=1))
