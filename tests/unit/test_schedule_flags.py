"""The schedule and clipping flags: what ps-trainer builds from them, and what ps-cluster passes on."""

import pytest

from psserver.protocol.schedules import LrSchedule
from trainer.running import cli
from trainer.local import cluster
from trainer.running.loop import TrainConfig, lr_schedule


def config(**kw) -> TrainConfig:
    return TrainConfig(ps="127.0.0.1:1", **kw)


def test_a_non_cosine_schedule_does_not_depend_on_the_run_length():
    # A trainer restarted with fewer --steps must still send the job's spec (tests/cluster/test_membership.py).
    for kind in ("constant", "step"):
        cfg = config(lr_schedule=kind, warmup_steps=5)
        assert lr_schedule(cfg, 100000) == lr_schedule(cfg, 20)
    assert lr_schedule(config(), 7) == LrSchedule()


def test_a_cosine_without_a_length_spans_the_runs_versions_after_the_warm_up():
    assert lr_schedule(config(lr_schedule="cosine", warmup_steps=10), 100).cosine_steps == 90
    assert lr_schedule(config(lr_schedule="cosine", warmup_steps=10, lr_cosine_steps=40), 100).cosine_steps == 40
    async_cfg = config(lr_schedule="cosine", mode="async", num_trainers=4, rank=1)
    assert lr_schedule(async_cfg, 100).cosine_steps == 400  # a version per push
    assert lr_schedule(config(lr_schedule="cosine", warmup_steps=50), 20).cosine_steps == 1  # never 0


def test_ps_cluster_passes_the_flags_on_to_each_trainer_unchanged(tmp_path):
    given = ["--lr-schedule", "step", "--warmup-steps", "3", "--warmup-start-factor", "0.3", "--lr-step-size", "7",
             "--lr-gamma", "0.25", "--lr-min", "0.001", "--clip-grad-norm", "1.5"]
    args = cluster.build_parser().parse_args(given)
    args.job_id = "j"
    argv = cluster.trainer_args(args, 0, tmp_path)
    trainer = cli.build_parser().parse_args(["--ps", "127.0.0.1:1", *argv])
    direct = cli.build_parser().parse_args(["--ps", "127.0.0.1:1", *given])
    assert {n: getattr(trainer, n) for n in cli.SCHEDULE_FLAGS} == {n: getattr(direct, n) for n in cli.SCHEDULE_FLAGS}
    assert "--clip-grad-norm" not in cluster.trainer_args(cluster.build_parser().parse_args([]), 0, tmp_path)


@pytest.mark.parametrize("flags,message", [
    (["--lr-gamma", "2"], "ps-cluster: error: The lr_schedule.gamma (2.0) must be greater than 0 and at most 1."),
    (["--clip-grad-norm", "0"], "ps-cluster: error: The clip_grad_norm (0.0) must be a finite number greater"),
])
def test_ps_cluster_refuses_bad_flags_in_one_line_before_starting_anything(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.run_cli("ps-cluster", lambda: cluster.main(flags + ["--run-dir", str(tmp_path / "run")]))
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # no run folder, no process
