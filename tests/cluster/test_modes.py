"""Real ps-server and ps-trainer processes, 2 shards x 2 trainers, CNN on mnist5k, each mode."""

import json
import subprocess
import sys

import pytest
import torch

from trainer.data import load_mnist5k
from trainer.loop import evaluate
from trainer.models import build_model

CNN_3_EPOCHS = ["--model", "cnn", "--dataset", "mnist5k", "--epochs", "3", "--batch-size", "32"]
MODE_ARGS = {
    "sync": ["--mode", "sync"],
    "async": ["--mode", "async"],
    "stale-timeout": ["--mode", "stale-timeout", "--sync-timeout", "0.5"],
}


@pytest.mark.parametrize("mode", list(MODE_ARGS))
def test_cnn_reaches_90_percent_in_3_epochs(cluster, tmp_path, mode):
    out = tmp_path / "model.pt"
    job = cluster(2, 2, CNN_3_EPOCHS + MODE_ARGS[mode], per_rank={0: ["--output", str(out)]})
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail() + job.trainers[1].log_tail()
    for rank in (0, 1):
        done = job.done(rank)
        assert done["steps"] == 3 * (4000 // 64)
        assert done["test_accuracy"] > 0.90, done
    # the saved model is a plain state dict for the same class, and it is the trained one
    model = build_model("cnn", (1, 28, 28))
    model.load_state_dict(torch.load(out))
    data = load_mnist5k()
    acc, _ = evaluate(model, data.x_test, data.y_test, torch.device("cpu"))
    assert acc > 0.90
    stats = [job.stats(i) for i in (0, 1)]
    pushes = 2 * 3 * 62
    for s in stats:
        assert s.counters["pushes_applied"] == pushes
        if mode == "async":
            assert s.version == pushes  # one optimizer step per push
        else:
            assert s.version == 3 * 62  # one step per round
            assert s.counters.get("rounds_all_arrived", 0) + s.counters.get("rounds_timeout", 0) == s.version


def test_stale_timeout_with_a_straggler_closes_rounds_at_the_timeout_and_counts_stale(cluster):
    args = ["--mode", "stale-timeout", "--sync-timeout", "0.05", "--model", "cnn", "--dataset", "mnist5k",
            "--steps", "30", "--batch-size", "32"]
    job = cluster(2, 2, args, per_rank={1: ["--step-delay", "0.25"]})
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[1].log_tail()
    straggler = job.done(1)
    fast = job.done(0)
    assert straggler["stale_pushes"] > 0 and fast["stale_pushes"] == 0
    stats = [job.stats(i) for i in (0, 1)]
    assert all(s.counters["rounds_timeout"] > 0 for s in stats)
    # every gradient the straggler was told was stale is counted by a shard, and nothing else is
    assert sum(s.counters["stale_dropped"] for s in stats) == straggler["stale_pushes"]
    # the fast trainer was not held back to the straggler's pace: it made more versions than the straggler's steps
    assert fast["versions"][0] > straggler["steps"] / 2


def test_trainer_with_a_different_job_is_refused_naming_the_difference(tmp_path):
    from trainer.procs import start_shard, start_trainer

    shard = start_shard(0, tmp_path / "shard0.log")
    args = ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--steps", "2", "--no-progress"]
    try:
        first = start_trainer(0, shard.address, tmp_path / "first.log", args)
        assert first.popen.wait(120) == 0, first.log_tail()
        second = start_trainer(0, shard.address, tmp_path / "second.log", args + ["--lr", "0.5"])
        assert second.popen.wait(120) == 1
        log = second.log_path.read_text()
        assert "FAILED_PRECONDITION" in log and "optimizer.lr is 0.5 but the job has 0.05" in log
        assert "Traceback" not in log
    finally:
        shard.kill()


def test_shards_listed_in_the_wrong_order_are_caught(tmp_path):
    from trainer.procs import start_shard, start_trainer

    shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(2)]
    try:
        t = start_trainer(0, f"{shards[1].address},{shards[0].address}", tmp_path / "t.log",
                          ["--model", "mlp", "--dataset", "synthetic", "--steps", "1", "--no-progress"])
        assert t.popen.wait(120) == 1
        assert "this is shard 1 but the trainer listed it as shard 0" in t.log_path.read_text()
    finally:
        for s in shards:
            s.kill()


def test_ps_cluster_runs_the_main_job_and_leaves_a_run_folder(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", "from trainer.cluster import entrypoint; entrypoint()", "--epochs", "1",
         "--run-dir", str(run)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "psgrpc run summary" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.85
    assert summary["rounds"] == 62 and summary["rounds_by_reason"]["all_arrived"] == 62
    for name in ("shard0.log", "shard1.log", "trainer0.log", "trainer1.log", "trainer0.jsonl", "model.pt"):
        assert (run / name).stat().st_size > 0, name
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
