"""`ps-cluster --reshard M@ROUND[,M@ROUND...]`: its parsing, its one-line refusals before anything starts, the
steps run one at a time (fake coordinators and shards: small Python processes, no network), and the summary's
hand-offs read from the coordinators' lines and rank 0's step records."""

import pytest

from psserver.common.cli_support import run_cli
from trainer.local import cluster
from trainer.local import reshard_cluster

BASE = ["--model", "mlp", "--dataset", "synthetic", "--steps", "40", "--shards", "2"]


def test_m_at_round_parses_to_the_shard_count_and_the_round():
    assert reshard_cluster.parse("3@20", 2) == [(3, 20)]


def test_a_sequence_parses_to_its_steps_in_order_and_a_smaller_m_is_a_drain():
    assert reshard_cluster.parse("3@20,2@60", 2) == [(3, 20), (2, 60)]
    assert reshard_cluster.parse("2@20", 3) == [(2, 20)]
    assert reshard_cluster.parse("4@10,3@20,2@30", 2) == [(4, 10), (3, 20), (2, 30)]


@pytest.mark.parametrize("flags,message", [
    (["--reshard", "3"], "--reshard '3' is not M@ROUND"),
    (["--reshard", "3@20,2"], "--reshard '3@20,2' is not M@ROUND"),
    (["--reshard", "2@20"], "--reshard 2@20: step 1 (2@20) changes nothing: 2 shards is the count before it "
                            "(--shards 2)"),
    (["--reshard", "3@10,3@20"], "step 2 (3@20) changes nothing: 3 shards is the count before it (step 1's 3)"),
    (["--reshard", "0@20"], "--reshard 0@20: step 1 (0@20): M must be 1 or more"),
    (["--reshard", "3@10,0@20"], "step 2 (0@20): M must be 1 or more"),
    (["--reshard", "3@0"], "--reshard 3@0: step 1 (3@0): ROUND must be 1 or more"),
    (["--reshard", "3@20,2@20"], "step 2 (2@20): rounds must increase, and 20 is not after step 1's 20"),
    (["--reshard", "3@20,2@10"], "step 2 (2@10): rounds must increase, and 10 is not after step 1's 20"),
    (["--reshard", "3@10,2@40"], "--reshard 3@10,2@40 needs --steps more than 40 (got 40)"),
    (["--reshard", "3@10,2@20,3@30"], "step 3 (3@30) would grow back onto shard 2, stopped after a drain"),
    (["--shards", "3", "--reshard", "2@10,3@20"], "step 2 (3@20) would grow back onto shard 2, stopped after a drain"),
    (["--reshard", "3@20", "--mode", "async", "--optimizer", "adam"],
     "--reshard of an async job takes --optimizer sgd, not adam"),
    (["--reshard", "3@20", "--mode", "async", "--push-window", "4"],
     "--reshard of an async job follows the switch with --push-window 1, not 4"),
    (["--reshard", "3@5", "--model", "mf", "--dataset", "movielens100k", "--embedding-mode", "async"],
     "--reshard moves sync tables only, not --embedding-mode async (--model mf's tables)"),
    (["--reshard", "3@5", "--model", "dlrm", "--dataset", "criteo-synth", "--embedding-mode", "stale-timeout"],
     "--reshard moves sync tables only, not --embedding-mode stale-timeout (--model dlrm's tables)"),
    (["--reshard", "3@20", "--elastic"], "--reshard and --elastic are separate scenarios"),
    (["--reshard", "3@40"], "--reshard 3@40 needs --steps more than 40 (got 40)"),
    (["--reshard", "3@10,2@50"], "--reshard 3@10,2@50 needs --steps more than 50 (got 40)"),
])
def test_a_reshard_it_cannot_show_is_one_line_with_a_hint_before_starting_anything(flags, message, capsys,
                                                                                  tmp_path):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_cli("ps-cluster", lambda: cluster.main([*BASE, "--run-dir", str(run), *flags]))
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2 and "hint:" in err, err  # the cause, then the hint
    assert not run.exists()  # refused before the run folder or any process


@pytest.mark.parametrize("model,dataset", [("mf", "movielens100k"), ("ncf", "movielens100k"),
                                           ("dlrm", "criteo-synth")])
def test_a_table_model_whose_tables_are_sync_is_accepted(model, dataset):
    for extra in ([], ["--embedding-mode", "sync"]):
        args = cluster.build_parser().parse_args([*BASE, "--reshard", "3@20", "--model", model, "--dataset", dataset,
                                                  *extra])
        assert reshard_cluster.check(args) == [(3, 20)]


def test_no_trainer_is_paced_every_one_records_every_step_and_a_straggler_keeps_its_delay():
    args = cluster.build_parser().parse_args([*BASE, "--reshard", "3@20", "--straggler-delay", "0.5"])
    assert reshard_cluster.trainer_flags(args, 0) == ["--log-every", "1"]
    rank0, rank1 = cluster.trainer_args(args, 0, cluster.Path("r")), cluster.trainer_args(args, 1, cluster.Path("r"))
    assert rank0[-2:] == ["--log-every", "1"] and "--step-delay" not in rank0
    assert rank1[rank1.index("--step-delay") + 1] == "0.5" and rank1.count("--step-delay") == 1


LINES = ["plan reshard-abc: a:1,b:2 -> a:1,b:2,c:3", "prepared: copying while training goes on",
         "committed: the new layout takes over at round 6", "switched (block 0.010 s)",
         "done: layout 1, 4096 bytes moved, hand-off 1.25 s"]


def test_the_handoff_names_the_committed_round_the_layout_the_seconds_and_the_rates_either_side_of_it():
    # rounds 1..6 one a second, then 6..10 two a second (fake step records: versions and time)
    times = {v: float(v) for v in range(1, 7)} | {v: 6 + (v - 6) / 2 for v in range(7, 11)}
    records = [{"event": "step", "versions": [v, v, v], "time": t} for v, t in times.items()]
    h = reshard_cluster.handoff(LINES, records + [{"event": "done"}], 4)
    assert h == dict(requested_round=4, round=6, layout=1, bytes_moved=4096, handoff_seconds=1.25,
                     steps_per_sec_before=1.0, steps_per_sec_after=2.0)
    rows = dict(reshard_cluster.summary_rows(h))
    assert rows["re-shard"] == "layout 1 from round 6 (asked at 4), hand-off 1.25 s"
    assert rows["steps/s before / after"] == "1.0 / 2.0"


def test_a_coordinator_that_said_nothing_leaves_the_handoff_unknown_rather_than_guessed():
    h = reshard_cluster.handoff([], [{"event": "step", "versions": [3], "time": 1.0}], 4)
    assert (h["round"], h["layout"], h["handoff_seconds"], h["steps_per_sec_before"], h["steps_per_sec_after"]) \
        == (None, None, None, None, None)
    assert dict(reshard_cluster.summary_rows(h))["steps/s before / after"] == "n/a / n/a"


def test_the_coordinators_lines_are_logged_once_each_as_they_complete_and_a_partial_last_one_at_the_end(
        tmp_path, caplog):
    scenario = reshard_cluster.ReshardScenario(4, ["a:1", "b:2"], ["a:1", "b:2", "c:3"], tmp_path)
    caplog.set_level("INFO", logger="ps-cluster")
    scenario.out.write_text("plan p: a -> b\nprepared: cop")
    scenario.say_new()
    scenario.say_new()
    assert scenario.lines == ["plan p: a -> b"]
    scenario.out.write_text("plan p: a -> b\nprepared: copying\ndone: layout 1")
    scenario.say_new(final=True)
    assert [r.getMessage() for r in caplog.records] == [
        "reshard: plan p: a -> b", "reshard: prepared: copying", "reshard: done: layout 1"]


def test_a_failed_coordinator_stops_the_run_naming_its_exit_code_and_its_last_lines(tmp_path):
    import subprocess
    import sys

    from trainer.local.procs import Proc

    scenario = reshard_cluster.ReshardScenario(4, ["a:1", "b:2"], ["a:1", "b:2", "c:3"], tmp_path)
    scenario.out.write_text("ps-server reshard: a:1 answered PREPARE with UNAVAILABLE: gone\n")
    popen = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    popen.wait()
    scenario.proc = Proc("reshard", popen, scenario.out)
    with pytest.raises(RuntimeError, match=r"ps-server reshard exited with 1; .*answered PREPARE with UNAVAILABLE"):
        scenario.poll()


FAKE_COORDINATOR = ("import sys; print(' '.join(sys.argv[1:]));"
                    " print('committed: the new layout takes over at round 5');"
                    " print('done: layout 1, 8 bytes moved, hand-off 0.50 s')")


def fake_shard(i: int, tmp_path):
    """A process standing for shard i: exits 0 on SIGTERM (as a drained ps-server must)."""
    import subprocess
    import sys

    from trainer.local.procs import Proc

    code = "import signal, sys; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print('up', flush=True); " \
           "signal.pause()"
    log = tmp_path / f"shard{i}.log"
    with open(log, "wb") as f:
        popen = subprocess.Popen([sys.executable, "-c", code], stdout=f)
    return Proc(f"shard{i}", popen, log, address=f"h:{i}")


def test_steps_run_one_coordinator_at_a_time_and_a_drain_stops_the_drained_shards_with_exit_code_0(
        tmp_path, monkeypatch):
    from tests.helpers import wait_until

    monkeypatch.setattr(reshard_cluster, "cli", lambda module: [cluster.sys.executable, "-c", FAKE_COORDINATOR])
    shards = [fake_shard(i, tmp_path) for i in range(3)]
    try:
        wait_until(lambda: all(p.log_path.read_text() for p in shards), "the fake shards' SIGTERM handlers")
        watched = list(shards)
        steps = reshard_cluster.ReshardSteps([(3, 4), (2, 9)], 2, shards, watched, tmp_path)
        steps.poll()
        assert len(steps.procs) == 1  # the second waits for the first to exit 0
        wait_until(lambda: steps.poll() or len(steps.done) == 2, "both steps to finish")
        results = steps.finish()
        assert [code for code, _ in results] == [0, 0]
        assert results[0][1][0] == "reshard --ps h:0,h:1 --to h:0,h:1,h:2 --wait 300 --at-round 4"
        assert results[1][1][0] == "reshard --ps h:0,h:1,h:2 --to h:0,h:1 --wait 300 --at-round 9"
        assert [p.name for p in steps.procs] == ["reshard", "reshard2"]
        assert (tmp_path / "reshard2.log").exists()
        assert watched == shards[:2] and shards[2].popen.returncode == 0  # drained: off the watch, exit code 0
        assert shards[0].alive() and shards[1].alive()
    finally:
        for p in shards:
            p.kill()


def test_a_step_that_never_started_is_reported_as_not_run_and_a_running_one_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(reshard_cluster, "cli", lambda module: [cluster.sys.executable, "-c",
                                                                 "import signal; signal.pause()"])
    steps = reshard_cluster.ReshardSteps([(3, 4), (2, 9)], 2, [], [], tmp_path)
    steps.poll()
    results = steps.finish()
    assert results[0][0] != 0 and results[1] == (None, [])
    assert not steps.procs[0].alive()


def test_each_steps_rates_are_measured_between_its_neighbours_committed_rounds():
    # rounds 1..6 one a second, 6..10 two a second, 10..14 four a second; R = 6 then 10
    times = ({v: float(v) for v in range(1, 7)} | {v: 6 + (v - 6) / 2 for v in range(7, 11)}
             | {v: 8 + (v - 10) / 4 for v in range(11, 15)})
    records = [{"event": "step", "versions": [v, v], "time": t} for v, t in times.items()]
    second = ["committed: the new layout takes over at round 10", "done: layout 2, 64 bytes moved, hand-off 0.75 s"]
    hs = reshard_cluster.handoffs([(0, LINES), (0, second)], records, [(3, 4), (2, 8)], 2)
    assert [(h["round"], h["layout"], h["shards_before"], h["shards_after"]) for h in hs] == [(6, 1, 2, 3),
                                                                                             (10, 2, 3, 2)]
    assert [(h["steps_per_sec_before"], h["steps_per_sec_after"]) for h in hs] == [(1.0, 2.0), (2.0, 4.0)]
    rows = reshard_cluster.steps_rows(hs)
    assert rows[0] == ("re-shard 1 (2 -> 3)", "layout 1 from round 6 (asked at 4), hand-off 1.25 s")
    assert rows[3] == ("steps/s before / after 2", "2.0 / 4.0")


def test_a_summary_written_before_the_steps_reads_as_one_step():
    old = dict(requested_round=4, round=6, layout=1, shard_versions=[9, 9, 9])
    assert reshard_cluster.as_steps(old) == [old]
    assert cluster.reshard_counts({"shards": 2, "reshard": old}) == [2, 3]
    assert cluster.reshard_counts({"shards": 2, "reshard": [dict(shards_after=3), dict(shards_after=2)]}) == [2, 3, 2]


class _Stats:
    def __init__(self, version, counters):
        self.version, self.counters = version, counters


def test_a_job_with_tables_adds_each_shards_table_versions_and_rows_to_the_last_step_and_a_summary_line():
    stats = [_Stats(60, {"steps": 43, "pushes_applied": 86, "table.user.version": 60, "table.user.live_rows": 300,
                         "table.item.version": 60, "table.item.live_rows": 500, "table.item.rows_created": 9})
             for _ in range(3)]
    h = reshard_cluster.with_shards(dict(requested_round=4, round=17), stats)
    assert h["shard_table_versions"] == [{"item": 60, "user": 60}] * 3
    assert h["shard_table_rows"] == [{"item": 500, "user": 300}] * 3
    assert reshard_cluster.table_rows(h) == [("tables: version (rows)",
                                              "item 60 (500) / 60 (500) / 60 (500); user 60 (300) / 60 (300) / 60 (300)")]


def test_a_dense_job_has_no_table_figures_and_no_table_line():
    h = reshard_cluster.with_shards(dict(round=17), [_Stats(60, {"steps": 43, "pushes_applied": 86})])
    assert "shard_table_versions" not in h and reshard_cluster.table_rows(h) == []
