"""`ps-cluster --elastic` as a user runs it: 2 trainers, a third joins a third of the way in, rank 1 is
SIGTERMed two thirds of the way; the summary prints 3 membership epochs.  Deterministic: the scenario acts on
rounds the trainers hold at (trainer.local.elastic_cluster), not on time."""

import json
import signal
import subprocess
import sys

STEPS = 12  # rank 0 holds at 4 (joiner admitted at 6), rank 1 at 8 (its announcing push: out from 9)


def run_cluster(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """ps-cluster run to the end; on a timeout it is interrupted (SIGINT), so it stops its own processes."""
    proc = subprocess.Popen([sys.executable, "-c", "from trainer.local.cluster import entrypoint; entrypoint()", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ps_cluster_elastic_prints_a_timeline_of_three_epochs_join_then_leave(tmp_path):
    run = tmp_path / "run"
    proc = run_cluster(["--elastic", "--steps", str(STEPS), "--model", "mlp", "--dataset", "synthetic",
                        "--batch-size", "8", "--run-dir", str(run), "--log-level", "WARNING"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.strip() for line in proc.stdout.splitlines()]
    assert ["membership", "epochs", "3"] in [x.split() for x in lines], proc.stdout
    printed = [x for x in lines if x.startswith("epoch ") and "ranks" in x]
    assert [x.split(": ")[0].split(")")[1].strip() for x in printed] == ["ranks 0, 1", "ranks 0, 1, 2", "ranks 0, 2"]
    timeline = json.loads((run / "summary.json").read_text())["membership"]
    assert [(e["round"], e["members"]) for e in timeline] == [(0, [0, 1]), (6, [0, 1, 2]), (9, [0, 2])]
    assert all(e["samples_per_sec"] and e["samples_per_sec"] > 0 for e in timeline)


def test_ps_cluster_elastic_refuses_a_mode_or_step_count_it_cannot_show_in_one_line(tmp_path):
    for flags, message in ((["--mode", "async", "--steps", "30"], "--elastic shows a sync job's membership epochs"),
                           (["--steps", "5"], "--elastic needs --steps 9 or more (got 5)")):
        proc = run_cluster(["--elastic", *flags, "--run-dir", str(tmp_path / "run")], timeout=120)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 2 and not (tmp_path / "run").exists()


def test_ps_cluster_elastic_schedule_admits_each_join_at_one_round_on_every_shard_and_lists_each_epoch(tmp_path):
    """1 -> 2 -> 3 trainers: rank 0 holds at 2 (the first joiner is admitted at 4), that joiner holds at 5 (the
    second at 7); both shards name the same rounds, and the summary prints and saves each epoch's members."""
    run = tmp_path / "run"
    proc = run_cluster(["--trainers", "1", "--elastic-schedule", "join@2,join@5", "--steps", "10", "--model", "mlp",
                        "--dataset", "synthetic", "--batch-size", "8", "--run-dir", str(run), "--log-level",
                        "WARNING"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scaling = json.loads((run / "summary.json").read_text())["scaling"]
    joins = [[0, [0]], [4, [0, 1]], [7, [0, 1, 2]]]
    assert [[e["round"], e["members"]] for e in scaling["epochs"]] == joins
    assert [[b for b in shard if b[0] < 10] for shard in scaling["boundaries"]] == [joins, joins]
    printed = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("epoch ")]
    assert [(x[:4], x[4]) for x in printed] == [(["epoch", "0", "(rounds", "0-3)"], "0"),
                                                 (["epoch", "1", "(rounds", "4-6)"], "0,1"),
                                                 (["epoch", "2", "(rounds", "7-9)"], "0,1,2")]
    assert "2 x 1 (+2 joining)" in proc.stdout and scaling["cores"] >= 1 and len(scaling["load"]) == 4
