"""`ps-cluster --reshard M@ROUND`: its parsing, its one-line refusals before anything starts, and the summary's
hand-off read from the coordinator's lines and rank 0's step records (no network, no processes)."""

import pytest

from psserver.common.cli_support import run_cli
from trainer import cluster, reshard_cluster

BASE = ["--model", "mlp", "--dataset", "synthetic", "--steps", "40", "--shards", "2"]


def test_m_at_round_parses_to_the_shard_count_and_the_round():
    assert reshard_cluster.parse("3@20", 2) == (3, 20)


@pytest.mark.parametrize("flags,message", [
    (["--reshard", "3"], "--reshard '3' is not M@ROUND"),
    (["--reshard", "2@20"], "--reshard 2@20 must grow the job: 2 shards is not more than --shards 2"),
    (["--reshard", "3@0"], "--reshard 3@0: ROUND must be 1 or more"),
    (["--reshard", "3@20", "--mode", "async"], "--reshard moves a sync job, not --mode async"),
    (["--reshard", "3@20", "--mode", "stale-timeout"], "--reshard moves a sync job, not --mode stale-timeout"),
    (["--reshard", "3@5", "--model", "mf", "--dataset", "movielens100k"], "dense models only"),
    (["--reshard", "3@20", "--elastic"], "--reshard and --elastic are separate scenarios"),
    (["--reshard", "3@40"], "--reshard 3@40 needs --steps more than 40 (got 40)"),
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

    from trainer.procs import Proc

    scenario = reshard_cluster.ReshardScenario(4, ["a:1", "b:2"], ["a:1", "b:2", "c:3"], tmp_path)
    scenario.out.write_text("ps-server reshard: a:1 answered PREPARE with UNAVAILABLE: gone\n")
    popen = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    popen.wait()
    scenario.proc = Proc("reshard", popen, scenario.out)
    with pytest.raises(RuntimeError, match=r"ps-server reshard exited with 1; .*answered PREPARE with UNAVAILABLE"):
        scenario.poll()
