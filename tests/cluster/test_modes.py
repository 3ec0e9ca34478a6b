"""Real ps-server and ps-trainer processes, 2 shards x 2 trainers, CNN on mnist5k, each mode."""

import json

import pytest
import torch

from trainer.workloads.data import load_mnist5k
from trainer.running.loop import evaluate
from trainer.workloads.models import build_model

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
    check_round_accounting(mode, [job.stats(i) for i in (0, 1)], [job.done(r) for r in (0, 1)], steps=3 * 62)


def check_round_accounting(mode: str, stats: list, done: list, steps: int) -> None:
    """What the shards counted, per mode, in terms that hold however loaded the machine is.

    Each shard gets one push per trainer and step.  sync: every round closes with both (one step per round,
    all by arrival).  async: one optimizer step per push, no rounds.  stale-timeout: a round may close at the
    timeout when a push is late (the late push is then dropped as stale), so what is asserted is the
    accounting -- applied + dropped == pushed, each round holds one or two pushes, and rounds close by arrival
    or timeout (or once at the end, by a Leave) -- not that every push was applied.
    """
    pushes = 2 * steps
    stale = sum(d["stale_pushes"] for d in done)
    for s in stats:
        c = s.counters
        rounds = {r: c.get(f"rounds_{r}", 0) for r in ("all_arrived", "quorum", "timeout", "membership")}
        if mode == "async":
            assert c["pushes_applied"] == pushes and s.version == pushes  # one optimizer step per push
            assert sum(rounds.values()) == 0, rounds
        elif mode == "sync":
            assert c["pushes_applied"] == pushes and s.version == steps  # one step per round
            assert rounds == {"all_arrived": steps, "quorum": 0, "timeout": 0, "membership": 0}
        else:
            assert c["pushes_applied"] + c.get("stale_dropped", 0) == pushes, dict(c)
            # no quorum was set; a membership close is a trainer's Leave at the end meeting the other's open round
            assert rounds["quorum"] == 0 and rounds["membership"] <= 1, rounds
            assert sum(rounds.values()) == s.version
            assert s.version <= c["pushes_applied"] <= 2 * s.version
    if mode != "stale-timeout":
        assert stale == 0
    # every push a trainer was told was stale is counted by a shard, and nothing else is
    assert sum(s.counters.get("stale_dropped", 0) for s in stats) == stale


def test_stale_timeout_with_a_straggler_closes_rounds_at_the_timeout_and_counts_stale(cluster):
    args = ["--mode", "stale-timeout", "--sync-timeout", "0.05", "--model", "cnn", "--dataset", "mnist5k",
            "--steps", "30", "--batch-size", "32"]
    # The straggler sleeps 0.5 s a step, ten times the timeout: a round waits for it only if the fast trainer is
    # itself that late, so rounds close at the timeout and most of the straggler's pushes miss theirs.
    job = cluster(2, 2, args, per_rank={1: ["--step-delay", "0.5"]})
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[1].log_tail()
    straggler, fast = job.done(1), job.done(0)
    assert straggler["stale_pushes"] > fast["stale_pushes"]
    stats = [job.stats(i) for i in (0, 1)]
    assert all(s.counters["rounds_timeout"] > 0 for s in stats)  # rounds did not wait for the straggler
    check_round_accounting("stale-timeout", stats, [fast, straggler], steps=30)


def test_trainer_with_a_different_job_is_refused_naming_the_difference(tmp_path):
    from psserver.protocol.stubs import fetch_stat
    from tests.helpers import wait_until
    from trainer.local.procs import start_shard, start_trainer

    shard = start_shard(0, tmp_path / "shard0.log")
    args = ["--num-trainers", "2", "--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--steps", "2",
            "--no-progress"]
    procs = [shard]
    try:
        first = start_trainer(0, shard.address, tmp_path / "first.log", args)  # waits for rank 1: the job runs
        procs.append(first)
        wait_until(lambda: fetch_stat(shard.address).counters["registrations"] >= 1, "rank 0 to register")
        second = start_trainer(1, shard.address, tmp_path / "second.log", args + ["--lr", "0.5"])
        procs.append(second)
        assert second.popen.wait(120) == 1
        log = second.log_path.read_text()
        assert "FAILED_PRECONDITION" in log and "optimizer.lr is 0.5 but the job has 0.05" in log
        assert "Traceback" not in log
    finally:
        for p in procs:
            p.kill()


def test_a_second_job_on_finished_shards_starts_fresh_and_waits_for_all_its_trainers(tmp_path):
    """Running the same command again on shards whose job ended is a new job: rank 1 alone cannot train on
    the old weights; it waits for rank 0 (its Init) and both count versions from 0."""
    from psserver.protocol.stubs import fetch_stat
    from trainer.local.procs import start_shard, start_trainer, wait_all

    shard = start_shard(0, tmp_path / "shard0.log")
    common = ["--num-trainers", "2", "--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--steps", "3",
              "--no-progress", "--threads", "1"]
    procs = [shard]
    try:
        for job in ("first", "second"):
            files = [tmp_path / f"{job}{r}.jsonl" for r in range(2)]
            # rank 1 first: on the old shard state it would have trained alone from the first job's weights
            trainers = [start_trainer(r, shard.address, tmp_path / f"{job}{r}.log",
                                      common + ["--metrics-file", str(files[r])]) for r in (1, 0)]
            procs += trainers
            assert wait_all(trainers, 180) == {"trainer1": 0, "trainer0": 0}
            for f in files:
                done = json.loads(f.read_text().splitlines()[-1])
                assert done["event"] == "done" and done["versions"] == [3]  # a fresh job: 3 rounds from 0
        st = fetch_stat(shard.address)
        assert st.counters["jobs_ended"] == 1 and st.version == 3
        assert "starts a new job from scratch" in shard.log_path.read_text()
    finally:
        for p in procs:
            p.kill()
