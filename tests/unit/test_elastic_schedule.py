"""`ps-cluster --elastic-schedule join@R,...` without processes: its parsing and one-line refusals before anything
starts, the flags each trainer gets (who holds where), and the per-epoch rates read from step records."""

from types import SimpleNamespace

import pytest

from psserver.common.cli_support import run_cli
from trainer.local import cluster
from trainer.local import elastic_schedule

BASE = ["--model", "mlp", "--dataset", "synthetic", "--steps", "40", "--trainers", "1"]


def args_of(*flags: str):
    return cluster.build_parser().parse_args([*BASE, *flags])


def test_join_at_rounds_parse_to_the_rounds_in_order():
    assert elastic_schedule.parse("join@20") == [20]
    assert elastic_schedule.parse("join@20, join@23,join@60") == [20, 23, 60]


@pytest.mark.parametrize("flags,message", [
    (["--elastic-schedule", "join"], "--elastic-schedule 'join': event 1 ('join') is not join@ROUND"),
    (["--elastic-schedule", "join@5,leave@9"], "event 2 ('leave@9') is not join@ROUND"),
    (["--elastic-schedule", "join@5,,join@9"], "event 2 ('') is not join@ROUND"),
    (["--elastic-schedule", "join@0"], "--elastic-schedule join@0: event 1 (join@0): ROUND must be 1 or more"),
    (["--elastic-schedule", "join@10,join@12"], "event 2 (join@12) must come 3 or more rounds after event 1's 10"),
    (["--elastic-schedule", "join@10,join@5"], "event 2 (join@5) must come 3 or more rounds after event 1's 10"),
    (["--elastic-schedule", "join@10,join@37"], "--elastic-schedule join@10,join@37 needs --steps more than 40 "
                                                "(got 40)"),
    (["--elastic-schedule", "join@10", "--mode", "stale-timeout"],
     "--elastic-schedule runs a sync or async job, not --mode stale-timeout"),
    (["--elastic-schedule", "join@10", "--elastic"], "--elastic-schedule and --elastic are separate scenarios"),
    (["--elastic-schedule", "join@10", "--reshard", "3@20", "--shards", "2"],
     "--elastic-schedule and --reshard are separate scenarios"),
])
def test_a_schedule_it_cannot_run_is_one_line_with_a_hint_before_starting_anything(flags, message, capsys, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_cli("ps-cluster", lambda: cluster.main([*BASE, "--run-dir", str(run), *flags]))
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2 and "hint:" in err, err  # the cause, then the hint
    assert not run.exists()  # refused before the run folder or any process


def test_sync_rank_0_holds_at_the_first_join_and_each_joiner_but_the_last_at_the_next():
    args = args_of("--elastic-schedule", "join@10,join@20,join@30")
    assert [elastic_schedule.hold_round(args, r) for r in range(4)] == [10, 20, 30, None]


def test_async_only_rank_0_holds_as_a_joiners_own_round_counts_its_own_steps():
    args = args_of("--elastic-schedule", "join@10,join@20,join@30", "--mode", "async")
    assert [elastic_schedule.hold_round(args, r) for r in range(4)] == [10, None, None, None]


def test_every_trainer_gets_the_jobs_max_trainers_and_the_same_threads_the_last_flag_winning(monkeypatch):
    monkeypatch.setattr(elastic_schedule.os, "cpu_count", lambda: 8)
    args = args_of("--elastic-schedule", "join@10,join@20,join@30")
    for rank in range(4):
        a = cluster.trainer_args(args, rank, cluster.Path("r"))
        assert a[a.index("--max-trainers") + 1] == "4"
        assert a[len(a) - 1 - a[::-1].index("--threads") + 1] == "2"  # 8 cores over the 4 trainers it reaches
    monkeypatch.setattr(elastic_schedule.os, "cpu_count", lambda: 2)
    assert elastic_schedule.threads(args) == 1  # never 0


def epoch(number: int, round_: int, members: list[int]):
    return SimpleNamespace(number=number, round=round_, members=members, size=len(members))


def step(version: int, t: float) -> dict:
    return {"event": "step", "versions": [version, version], "time": t}


def test_each_epoch_is_measured_without_its_first_round_and_the_two_held_before_a_join():
    epochs = [epoch(0, 0, [0]), epoch(1, 12, [0, 1]), epoch(2, 100, [0])]  # the last: a final leave
    # rank 0: rounds 0-9 take 1 s, the two held rounds 10-11 take 50 s, then 2 s each; rank 1 sees later
    times = {v: float(v) for v in range(11)} | {11: 60.0, 12: 110.0} | {v: 110.0 + 2 * (v - 12) for v in range(13, 31)}
    seen = elastic_schedule.version_times([[step(v, t) for v, t in times.items()],
                                           [step(v, t + 0.5) for v, t in times.items() if v >= 13]])
    rows = elastic_schedule.scaling_rows(epochs, seen, steps=30, batch=8, mode="sync", cores=2, per_trainer=1)
    assert [(r["members"], r["measured"]) for r in rows] == [([0], [1, 10]), ([0, 1], [13, 30])]
    assert rows[0]["versions_per_sec"] == 1.0 and rows[1]["versions_per_sec"] == 0.5
    assert rows[0]["samples_per_sec"] == 8.0 and rows[1]["samples_per_sec"] == 8.0  # 2 members x 8 x 0.5
    assert [r["ratio"] for r in rows] == [1.0, 1.0] and [r["ideal"] for r in rows] == [1.0, 2.0]


def test_the_cores_bound_the_expectation_once_the_trainers_threads_fill_them():
    epochs = [epoch(k, 10 * k, list(range(k + 1))) for k in range(4)]
    seen = {v: float(v) for v in range(41)}
    rows = elastic_schedule.scaling_rows(epochs, seen, steps=40, batch=1, mode="sync", cores=2, per_trainer=1)
    assert [r["ideal"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["bound_here"] for r in rows] == [1.0, 2.0, 2.0, 2.0]
    assert [r["ratio"] for r in rows] == [1.0, 2.0, 3.0, 4.0]  # one round a second, N members each


def test_async_samples_are_one_batch_per_push_and_the_last_epoch_ends_at_the_first_leave():
    epochs = [epoch(0, 0, [0]), epoch(1, 50, [0, 1]), epoch(2, 90, [1])]
    seen = {v: v / 10 for v in range(0, 50)} | {v: 5 + (v - 50) / 20 for v in range(50, 120)}
    rows = elastic_schedule.scaling_rows(epochs, seen, steps=60, batch=4, mode="async", cores=2, per_trainer=1)
    assert [(r["round"], r["rounds"], r["measured"]) for r in rows] == [(0, 50, [1, 48]), (50, 40, [51, 90])]
    assert rows[0]["samples_per_sec"] == pytest.approx(40.0) and rows[1]["samples_per_sec"] == pytest.approx(80.0)


def test_an_epoch_with_too_few_records_to_measure_says_so_instead_of_a_number():
    rows = elastic_schedule.scaling_rows([epoch(0, 0, [0]), epoch(1, 4, [0, 1])], {1: 1.0, 2: 2.0, 3: 3.0}, steps=8,
                                         batch=1, mode="sync", cores=2, per_trainer=1)
    assert rows[1]["versions_per_sec"] is None and rows[1]["samples_per_sec"] is None and rows[1]["ratio"] is None
    lines = elastic_schedule.summary_rows(dict(mode="sync", cores=2, epochs=rows, load=[1.5, 2.0]))
    assert lines[0][0] == "scaling (sync, 2 cores)" and "rounds/s" in lines[0][1]
    assert lines[2][0] == "epoch 1 (rounds 4-7)" and lines[2][1].split()[:4] == ["0,1", "n/a", "n/a", "n/a"]
    assert lines[-1] == ("load (1 min) at start / joins", "1.50 / 2.00")


def test_the_cores_used_and_samples_per_cpu_second_come_from_the_cpu_samples_inside_the_window():
    epochs = [epoch(0, 0, [0]), epoch(1, 12, [0, 1])]
    seen = {v: float(v) for v in range(31)}
    # (time, version, CPU s, the shards' CPU s): 1 core used in epoch 0, 2 in epoch 1; samples outside the
    # windows ignored, and those at a window's last version (a held round: the joiner starting) too
    cpu = [(0.0, 0, 0.0, 0.0), (1.0, 1, 1.0, 0.5), (9.0, 9, 9.0, 4.5), (10.0, 10, 50.0, 5.0),
           (13.0, 13, 60.0, 10.0), (29.0, 29, 92.0, 26.0), (40.0, 30, 99.0, 30.0)]
    rows = elastic_schedule.scaling_rows(epochs, seen, steps=30, batch=8, mode="sync", cores=2, per_trainer=1,
                                         cpu=cpu)
    assert [r["cores_used"] for r in rows] == [1.0, 2.0] and [r["shard_cores_used"] for r in rows] == [0.5, 1.0]
    assert [r["samples_per_cpu_sec"] for r in rows] == [8.0, 8.0]  # 8 rounds x 8 / 8 s; 16 x 16 / 32 s


def test_without_cpu_samples_the_cpu_columns_say_nothing_rather_than_a_number():
    rows = elastic_schedule.scaling_rows([epoch(0, 0, [0])], {v: float(v) for v in range(9)}, steps=8, batch=1,
                                         mode="sync", cores=2, per_trainer=1)
    assert rows[0]["cores_used"] is None and rows[0]["samples_per_cpu_sec"] is None
    line = elastic_schedule.summary_rows(dict(mode="sync", cores=2, epochs=rows, load=[1.0]))[1][1]
    assert line.split()[-2:] == ["n/a", "n/a"]


def test_a_live_process_has_cpu_seconds_and_a_gone_one_has_none():
    import os

    assert elastic_schedule.cpu_seconds(os.getpid()) > 0
    assert elastic_schedule.cpu_seconds(2 ** 22 + 1) is None  # above Linux's largest pid
