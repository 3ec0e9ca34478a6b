"""`ps-server --tensorboard DIR`: a real shard and trainer; the event files read back hold the shard's counts."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.local.procs import start_shard, start_trainer, wait_all


def scalars(directory) -> dict:
    """tag -> the last value written under that tag."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def test_shard_and_trainer_write_their_scalars_to_tensorboard(tmp_path):
    steps = 6
    board = tmp_path / "tb"
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=["--tensorboard", str(board)])
    try:
        trainer = start_trainer(0, shard.address, tmp_path / "t0.log",
                                ["--num-trainers", "1", "--model", "mlp", "--dataset", "synthetic", "--steps",
                                 str(steps), "--lr", "0.125", "--no-progress", "--threads", "1",
                                 "--log-every", "2", "--tensorboard", str(board)])
        assert wait_all([trainer], 300) == {"trainer0": 0}, trainer.log_tail()
        assert shard.terminate() == 0  # stopping takes a last sample, so no waiting for the interval
    finally:
        trainer.kill()
        shard.kill()
    got = scalars(board / "shard0")
    assert got["version"] == steps and got["optimizer_steps"] == steps
    assert got["pushes/applied"] == steps and got["pushes/stale_dropped"] == 0 and got["pushes/duplicate"] == 0
    assert got["rounds_closed/all_arrived"] == steps and got["rounds_closed/timeout"] == 0
    assert got["lr"] == 0.125 and got["live_trainers"] == 0
    acc = EventAccumulator(str(board / "trainer0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]  # every --log-every steps
    assert [e.value for e in acc.Scalars("train/staleness")] == [0, 0, 0]  # sync, one trainer: never behind
    assert [e.step for e in acc.Scalars("test/accuracy")] == [steps]  # the end-of-epoch evaluation
    assert 0 <= acc.Scalars("test/accuracy")[-1].value <= 1
