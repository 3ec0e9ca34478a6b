"""`ps-cluster --reshard 3@R` as a user runs it: two sync trainers on two shards, a third shard started empty,
the job moved onto all three live when shard 0 reaches R (trainer.local.reshard_cluster).  The trainers are not paced;
the coordinator, started with them, prepares at round AT (``--at-round``) and round R-1's replies wait for the
switch, so the trainers cannot finish before it once R is committed; STEPS leaves the copy and PROPOSE room
(asserted: R < STEPS)."""

import json

from tests.cluster.test_cluster_elastic import run_cluster

STEPS, AT = 120, 4


def test_ps_cluster_reshard_moves_a_sync_job_to_three_shards_and_each_applies_every_round_once(tmp_path):
    run = tmp_path / "run"
    proc = run_cluster(["--shards", "2", "--trainers", "2", "--reshard", f"3@{AT}", "--steps", str(STEPS),
                        "--model", "mlp", "--dataset", "synthetic", "--batch-size", "8", "--device", "cpu",
                        "--run-dir", str(run), "--log-level", "INFO"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    [h] = summary["reshard"]  # one step: a list of one, each step's keys as before the steps
    assert h["layout"] == 1 and AT <= h["round"] < STEPS, h
    assert f"layout 1 from round {h['round']}" in proc.stdout, proc.stdout
    assert "reshard: done: layout 1" in proc.stderr, proc.stderr[-3000:]
    assert h["handoff_seconds"] > 0 and h["steps_per_sec_before"] > 0 and h["steps_per_sec_after"] > 0, h
    assert summary["exit_codes"] == {"trainer0": 0, "trainer1": 0, "reshard": 0, "shard0": 0, "shard1": 0,
                                     "shard2": 0}, summary["exit_codes"]
    # every shard's version is the job's steps and each of a shard's rounds was applied once (2 pushes a round)
    assert summary["rounds"] == STEPS
    n = STEPS - h["round"]
    assert (h["shard_versions"], h["shard_rounds"], h["shard_pushes_applied"]) == (
        [STEPS] * 3, [n] * 3, [2 * n] * 3), h
    assert summary["steps"] == [STEPS, STEPS]
    assert summary["duplicates"] == 0
    versions = [json.loads(l) for l in (run / "trainer0.jsonl").read_text().splitlines() if l.startswith("{")]
    done = next(r for r in reversed(versions) if r["event"] == "done")
    assert done["versions"] == [STEPS] * 3 and done["layouts_followed"] == 1, done
    assert (done["retries"], done.get("pushes_rerouted", 0)) == (0, 0), done  # never refused, never re-routed


DRAIN_STEPS, AT2 = 300, 8


def test_ps_cluster_reshard_grows_then_drains_2_3_2_each_layout_applies_its_rounds_once_and_the_drained_shard_exits_0(
        tmp_path):
    """2 -> 3 -> 2: the second coordinator starts once the first exited 0 (its start-up, seconds, is spent while
    the job trains on: AT2 is long past by then and it prepares at once; DRAIN_STEPS leaves it room)."""
    run = tmp_path / "run"
    proc = run_cluster(["--shards", "2", "--trainers", "2", "--reshard", f"3@{AT},2@{AT2}", "--steps",
                        str(DRAIN_STEPS), "--model", "mlp", "--dataset", "synthetic", "--batch-size", "8",
                        "--device", "cpu", "--run-dir", str(run), "--log-level", "INFO"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    grow, drain = summary["reshard"]
    assert (grow["layout"], grow["shards_before"], grow["shards_after"]) == (1, 2, 3), grow
    assert (drain["layout"], drain["shards_before"], drain["shards_after"]) == (2, 3, 2), drain
    assert AT <= grow["round"] < drain["round"] < DRAIN_STEPS and drain["round"] >= AT2, (grow, drain)
    assert "re-sharded live: 2 -> 3 -> 2 shards" in proc.stdout, proc.stdout
    assert "reshard: drained" in proc.stderr and "shard2 drained and stopped (exit code 0)" in proc.stderr
    assert summary["exit_codes"] == {"trainer0": 0, "trainer1": 0, "reshard": 0, "reshard2": 0, "shard0": 0,
                                     "shard1": 0, "shard2": 0}, summary["exit_codes"]
    # both remaining shards end at the job's steps and layout 2 applied rounds R2.. once each (2 pushes a round)
    n = DRAIN_STEPS - drain["round"]
    assert (drain["shard_versions"], drain["shard_rounds"], drain["shard_pushes_applied"]) == (
        [DRAIN_STEPS] * 2, [n] * 2, [2 * n] * 2), drain
    assert summary["rounds"] == DRAIN_STEPS and summary["steps"] == [DRAIN_STEPS] * 2
    assert summary["duplicates"] == 0
    for rank in (0, 1):  # each trainer followed both layouts, nothing refused, retried or re-routed
        records = [json.loads(l) for l in (run / f"trainer{rank}.jsonl").read_text().splitlines() if l.startswith("{")]
        done = next(r for r in reversed(records) if r["event"] == "done")
        assert done["versions"] == [DRAIN_STEPS] * 2 and done["layouts_followed"] == 2, done
        # each step's versions: every shard of its layout one round on, so each layout applied each round once
        R1, R2 = grow["round"], drain["round"]
        wrong = [(r["step"], r["versions"]) for r in records if r["event"] == "step"
                 and r["versions"] != [r["step"]] * (3 if R1 < r["step"] <= R2 else 2)]
        assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, DRAIN_STEPS + 1))
        assert not wrong, wrong[:5]
        assert (done["retries"], done.get("pushes_rerouted", 0)) == (0, 0), done


TABLE_STEPS = 60


def test_ps_cluster_reshard_moves_a_sync_table_job_ncf_live_and_its_summary_names_rows_moved_and_table_versions(
        tmp_path):
    """NCF on MovieLens-100k (a dense MLP and two sync tables, Adagrad rows) grown 2 -> 3 with the cluster command:
    the summary's hand-off counts the rows' bytes, every shard's tables end at the job's version, and the trainers
    followed the switch with their tables, nothing refused, retried or re-routed (exactness of the rows:
    tests/cluster/test_live_reshard_tables.py)."""
    run = tmp_path / "run"
    proc = run_cluster(["--shards", "2", "--trainers", "2", "--reshard", f"3@{AT}", "--steps", str(TABLE_STEPS),
                        "--model", "ncf", "--dataset", "movielens100k", "--batch-size", "64", "--sparse-optimizer",
                        "adagrad", "--device", "cpu", "--run-dir", str(run), "--log-level", "INFO"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    [h] = summary["reshard"]
    assert h["layout"] == 1 and AT <= h["round"] < TABLE_STEPS, h
    assert h["handoff_seconds"] > 0 and h["steps_per_sec_before"] > 0 and h["steps_per_sec_after"] > 0, h
    # NCF's dense slice with Adam's two states is 6,274 x 3 x 4 bytes (75 kB): the rest of what moved is rows
    assert h["bytes_moved"] > 500_000, h
    assert summary["exit_codes"] == {"trainer0": 0, "trainer1": 0, "reshard": 0, "shard0": 0, "shard1": 0,
                                     "shard2": 0}, summary["exit_codes"]
    n = TABLE_STEPS - h["round"]
    assert (h["shard_versions"], h["shard_rounds"], h["shard_pushes_applied"]) == (
        [TABLE_STEPS] * 3, [n] * 3, [2 * n] * 3), h
    assert h["shard_table_versions"] == [{"item": TABLE_STEPS, "user": TABLE_STEPS}] * 3, h
    assert all(r["item"] > 0 and r["user"] > 0 for r in h["shard_table_rows"]), h  # rows spread over all three
    assert "tables: version (rows)" in proc.stdout, proc.stdout
    assert summary["duplicates"] == 0
    for rank in (0, 1):
        records = [json.loads(l) for l in (run / f"trainer{rank}.jsonl").read_text().splitlines() if l.startswith("{")]
        done = next(r for r in reversed(records) if r["event"] == "done")
        assert (done["layouts_followed"], done["rows_tables_relaid"], done["retries"], done.get("pushes_rerouted", 0),
                done.get("row_pushes_rerouted", 0)) == (1, 1, 0, 0, 0), done


TABLE_DRAIN_STEPS = 200


def test_ps_cluster_reshard_grows_then_drains_a_sync_table_job_2_3_2_and_each_layout_applies_its_rounds_once(tmp_path):
    """NCF through 2 -> 3 -> 2 with the cluster command: the drained shard's rows go back to the two remaining
    shards (tests/integration/test_handoff_rows_io.py checks them row by row), both end with every table at the job's
    version, each layout applied each of its rounds once, and the trainers followed both layouts with their tables,
    nothing retried or re-routed."""
    run = tmp_path / "run"
    proc = run_cluster(["--shards", "2", "--trainers", "2", "--reshard", f"3@{AT},2@{AT2}", "--steps",
                        str(TABLE_DRAIN_STEPS), "--model", "ncf", "--dataset", "movielens100k", "--batch-size", "64",
                        "--sparse-optimizer", "adagrad", "--device", "cpu", "--run-dir", str(run), "--log-level",
                        "INFO"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    grow, drain = summary["reshard"]
    assert AT <= grow["round"] < drain["round"] < TABLE_DRAIN_STEPS, (grow, drain)
    assert "shard2 drained and stopped (exit code 0)" in proc.stderr
    assert set(summary["exit_codes"].values()) == {0} and len(summary["exit_codes"]) == 7, summary["exit_codes"]
    n = TABLE_DRAIN_STEPS - drain["round"]
    assert (drain["shard_versions"], drain["shard_rounds"], drain["shard_pushes_applied"]) == (
        [TABLE_DRAIN_STEPS] * 2, [n] * 2, [2 * n] * 2), drain
    assert drain["shard_table_versions"] == [{"item": TABLE_DRAIN_STEPS, "user": TABLE_DRAIN_STEPS}] * 2, drain
    for rank in (0, 1):
        records = [json.loads(l) for l in (run / f"trainer{rank}.jsonl").read_text().splitlines() if l.startswith("{")]
        done = next(r for r in reversed(records) if r["event"] == "done")
        assert done["versions"] == [TABLE_DRAIN_STEPS] * 2, done
        assert (done["layouts_followed"], done["rows_tables_relaid"], done["retries"], done.get("pushes_rerouted", 0),
                done.get("row_pushes_rerouted", 0)) == (2, 2, 0, 0, 0), done
