"""`ps-bench --quick` runs end to end and writes its tables (a smoke test: no timing assertions)."""

import json
import subprocess
import sys


def test_ps_bench_quick_writes_json_and_markdown(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-c", "from trainer.bench import entrypoint; entrypoint()", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    systems = {(r["backend"], r["mode"]) for r in results["throughput"]}
    assert systems == {("ps", "sync"), ("ps", "sync+early"), ("ps", "async"), ("ps", "async+overlap"), ("ps", "stale-timeout"), ("ddp", ""),
                       ("local", "")}
    for r in results["throughput"]:
        assert r["samples_per_sec"] > 0 and r["steps"] == 15 and r["steady_steps"] == 13
    for c in results["comm"]:
        assert c["step_seconds"] > 0 and c["tcp_floor_seconds"] > 0 and c["apply_seconds"] > 0
        assert c["shard_memory_ratio_marginal"] <= c["shard_memory_ratio"]
    md = (out / "bench.md").read_text()
    assert "ratio to floor" in md and "DDP gloo" in md and md in proc.stdout
