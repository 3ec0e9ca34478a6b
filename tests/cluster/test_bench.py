"""`ps-bench --quick` runs end to end and writes its tables (a smoke test: no timing assertions)."""

import json
import subprocess
import sys

from trainer.tools.floors import setups


def test_ps_bench_quick_writes_json_and_markdown(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-c", "from trainer.tools.bench import entrypoint; entrypoint()", "--quick",
                           "--out", str(out), "--floor-connections", "1,2", "--floor-processes", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    # DDP over NCCL runs only where every trainer has a GPU of its own (a row, or a skipped baseline, on a GPU host)
    systems = {(r["backend"], r["mode"], r.get("variant", "")) for r in results["throughput"]} - {("ddp-nccl", "", "")}
    partitioned = f"--partition-bytes {4 << 20} --pipeline"
    assert systems == {
        ("ps", "sync", ""), ("ps", "sync+early", ""), ("ps", "async", ""), ("ps", "async+overlap", ""),
        ("ps", "stale-timeout", ""), ("ps", "sync", "--wire-dtype bfloat16"), ("ps", "sync", "--compress topk:0.01"),
        ("ps", "sync", "--pipeline"), ("ps", "sync", partitioned), ("ps", "sync+early", partitioned),
        ("ps", "async", "--push-window 4"), ("ddp", "", ""), ("local", "", "")}
    assert [k for k in results["skipped_rows"] if "extra_row" in k] == []  # ps-trainer has every extra row's flags
    for r in results["throughput"]:
        assert r["samples_per_sec"] > 0 and r["steps"] == 15 and r["steady_steps"] == 13
        assert r["device"] == "cpu" or r["device"].startswith("cuda")
        assert r["step_ms"] > 0 and r["overlap_efficiency"] > 0
    for c in results["comm"]:
        assert c["step_seconds"] > 0 and c["tcp_floor_seconds"] > 0 and c["apply_seconds"] > 0
        assert c["shard_memory_ratio_marginal"] <= c["shard_memory_ratio"]
    measured = [(f["model"], f["connections"], f["transport"], f["processes"]) for f in results["floors"]]
    assert measured == [(model, m, t, p) for m, t, p in setups([1, 2], [2]) for model in ("cnn", "resnet18")]
    assert all(f["step_seconds"] > 0 and f["gb_per_sec"] > 0 for f in results["floors"])
    resnet = results["resnet18_comm"]
    assert resnet["ratio_to_tcp_floor"] > 0 and resnet["ratio_to_grpc_floor"] > 0
    md = (out / "bench.md").read_text()
    assert "ratio to floor" in md and "DDP gloo" in md and md in proc.stdout
    assert "**Transport floors**" in md and "overlap eff." in md and "raw TCP floor" in md
    sparse = results["sparse"]
    one, sharded = sparse["throughput"]
    assert one["shards"] == 0 and sharded["shards"] == 1 and sharded["ids_per_s"] > 0 < one["ids_per_s"]
    # the rows moved are exactly the unique ids' rows both ways; ids and headers come on top
    assert sharded["bytes_per_step"] > sharded["row_bytes_per_step"] > 0
    assert sparse["memory"]["samples"][-1]["live_rows"] <= 20_000  # the cap held
    assert "**Sparse tables**" in md
    rows = results["rows"]  # the shard's own time per 2,048-row pull and push (docs/bench/engine/rowbench.py)
    assert [r["mode"] for r in rows] == ["sync", "async, max_staleness 2"]
    assert all(r["rows"] == 2048 and r["pull_cpu_ms"] > 0 < r["push_cpu_ms"] for r in rows)
    grid = results["sparse_grid"]  # --quick: click, batch 512, 1 shard x 1 trainer, each way a user runs it
    assert [(g["system"], g["shards"], g["trainers"], g["push_window"], g["cache_rows"]) for g in grid] == [
        ("psgrpc sync", 1, 1, 1, 0), ("psgrpc sync dense, async tables", 1, 1, 1, 0),
        ("psgrpc sync dense, async tables, push window 4", 1, 1, 4, 0),
        ("psgrpc sync dense, async tables, row cache (100,000 rows, bound 4)", 1, 1, 1, 100_000)]
    for g in grid:  # each with its own one-process run, its floor and the load average around the pair
        assert g["steps"] == g["one_process"]["steps"] == 8 and g["ratio"] > 0 and len(g["load_1m"]) == 2
        assert g["row_bytes_per_step"] > g["unique_bytes_per_step"] > 0
        assert g["floor"]["steps_per_s"] > 0 and g["floor"]["transport_ms"] > 0
        assert g["floor"]["request_bytes"][0] > 0 < g["floor"]["reply_bytes"][0]
    assert grid[0]["prefetch_hit_rate"] > 0 and grid[3]["cache_hit_rate"] is not None
    assert "**Shard row work**" in md and "**Sparse grid**" in md
