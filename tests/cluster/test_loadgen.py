"""`ps-loadgen` drives a real shard end to end (no timing assertions: the CI box is a loaded 2-core machine).

Asserted is what could fail but must not: in sync mode every round of the
measured window holds every trainer's push (client and shard agree on the
count), no call fails, no health probe fails, the files are written, and no
process outlives the run.
"""

import json
import multiprocessing
import os

import pytest

import trainer.local.procs
from trainer.tools import loadgen

pytestmark = pytest.mark.cluster


@pytest.fixture
def started_shards(monkeypatch):
    """Every shard the load generator starts; killed afterwards if it is somehow still running."""
    procs = []
    real = trainer.local.procs.start_shard

    def start_shard(*args, **kwargs):
        proc = real(*args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(trainer.local.procs, "start_shard", start_shard)
    yield procs
    for p in procs:
        p.kill()
    for child in multiprocessing.active_children():
        child.kill()
        child.join()


def assert_nothing_left(procs):
    assert procs, "the load generator started no shard"
    assert all(not p.alive() for p in procs), "a shard outlived the run"
    assert multiprocessing.active_children() == [], "a client or prober process outlived the run"


def test_quick_sync_run_closes_full_rounds_without_errors(tmp_path, started_shards, capsys):
    out = tmp_path / "loadgen"
    assert loadgen.main(["--quick", "--mode", "sync", "--out", str(out)]) == 0
    assert_nothing_left(started_shards)

    result = json.loads((out / "loadgen.json").read_text())
    rows = result["rows"]
    assert [r["trainers"] for r in rows] == [1, 4]
    for r in rows:
        n = r["trainers"]
        assert r["status"] == "ok", r
        assert r["rounds"] > 0
        # Every round of the window holds exactly one push from each trainer, each applied or accepted.
        assert r["pushes"] == n * r["rounds"] and r["full_rounds"] is True
        assert set(r["outcomes"]) <= {"applied", "accepted"} and sum(r["outcomes"].values()) == r["pushes"]
        # The shard's own version agrees with the newest version any trainer was sent.
        assert r["shard_stats"]["version"] == r["rounds_total"] >= r["rounds"]
        assert r["errors"] == {} and r["leave_errors"] == {} and r["crashes"] == []
        assert r["health"]["count"] > 0 and r["health"]["failures"] == {}
        assert r["shard"]["rss_end_mb"] > 0 and r["shard"]["cpu_per_s"] is not None
    assert rows[1]["shard"]["rss_growth_kb_per_trainer"] is not None

    # Without --health-port the shard has no health port and its column reads "-".
    assert all("health_port" not in r and "health_port_window" not in r for r in rows)
    assert all("--health-port" not in p.popen.args for p in started_shards)

    md = (out / "loadgen.md").read_text()
    assert "| 1 | ok |" in md and "| 4 | ok |" in md
    header = next(x for x in md.splitlines() if x.startswith("| N |"))
    column = [c.strip() for c in header.strip("|").split("|")].index("health port p50 / p99 / max ms")
    for line in (x for x in md.splitlines() if x.startswith(("| 1 |", "| 4 |"))):
        assert [c.strip() for c in line.strip("|").split("|")][column] == "-"
    assert md in capsys.readouterr().out
    assert (out / "loadgen.png").read_bytes()[:4] == b"\x89PNG"


def test_stall_scenario_reports_each_phase_and_recovers(tmp_path, started_shards):
    out = tmp_path / "stall"
    assert loadgen.main(["stall", "--streams", "4", "--quick", "--out", str(out)]) == 0
    assert_nothing_left(started_shards)

    stall = json.loads((out / "loadgen.json").read_text())["stall"]
    assert stall["status"] == "ok" and stall["crashes"] == []
    assert [p["phase"] for p in stall["phases"]] == ["unloaded", "stalled", "released"]
    by = {p["phase"]: p for p in stall["phases"]}
    # Whatever the stalled streams do to the shard, the job runs before them and again after them.
    assert by["unloaded"]["steps"] > 0 and by["unloaded"]["errors"] == {}
    assert by["released"]["steps"] > 0
    assert stall["stranger"]["streams"] == 4 and "open_at_release" in stall["stranger"]
    assert all(p["health"]["count"] > 0 for p in stall["phases"])
    assert "Stall:" in (out / "loadgen.md").read_text()
    assert not os.path.exists(out / "loadgen.png")  # no scaling rows, no plot


def test_quick_run_with_health_port_probes_both_ports(tmp_path, started_shards, capsys):
    out = tmp_path / "health-port"
    assert loadgen.main(["--quick", "--mode", "sync", "--health-port", "--out", str(out)]) == 0
    assert_nothing_left(started_shards)
    # Each shard was started with a health port of its own.
    for p in started_shards:
        assert "--health-port" in p.popen.args

    result = json.loads((out / "loadgen.json").read_text())
    rows = result["rows"]
    assert [r["trainers"] for r in rows] == [1, 4]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["health"]["count"] > 0 and r["health"]["failures"] == {}
        # The second prober ran beside the first: probes answered SERVING, none failed (timings not asserted).
        assert r["health_port"]["count"] > 0 and r["health_port"]["failures"] == {}, r["health_port"]
        assert r["health_port_window"]["failures"] == {}
        assert set(r["health_port"]) == set(r["health"])

    md = (out / "loadgen.md").read_text()
    assert "| health p50 / p99 / max ms | health port p50 / p99 / max ms | health fails |" in md
    for r in rows:
        hp = r["health_port"]
        assert f"| {hp['p50_ms']:.1f} / {hp['p99_ms']:.1f} / {hp['max_ms']:.1f} |" in md
    assert md in capsys.readouterr().out


def test_health_port_with_an_external_shard_is_refused():
    with pytest.raises(ValueError, match="--health-address"):
        loadgen.main(["--quick", "--ps", "127.0.0.1:1", "--health-port"])
