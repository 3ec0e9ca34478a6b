"""--compress on ps-trainer and ps-cluster: passed on unchanged, and a mistake is one line before anything starts."""

import pytest

from trainer.running import cli

from trainer.local import cluster
from trainer.running.loop import TrainConfig


def test_ps_cluster_passes_compress_on_to_each_trainer_and_leaves_it_out_when_unset(tmp_path):
    args = cluster.build_parser().parse_args(["--compress", "topk:0.01,warmup=15"])
    args.job_id = "j"
    trainer = cli.build_parser().parse_args(["--ps", "127.0.0.1:1", *cluster.trainer_args(args, 1, tmp_path)])
    assert cli.config_from_args(trainer).compress == "topk:0.01,warmup=15"
    plain = cluster.build_parser().parse_args([])
    plain.job_id = "j"
    assert "--compress" not in cluster.trainer_args(plain, 0, tmp_path)


@pytest.mark.parametrize("prog,flags,message", [
    ("ps-cluster", ["--compress", "topk:0"], "ps-cluster: error: --compress (topk:0): the ratio (0) must be above 0"),
    ("ps-cluster", ["--compress", "top5"], "ps-cluster: error: --compress (top5) is not a known compression"),
    ("ps-trainer", ["--compress", "topk:x"], "ps-trainer: error: --compress (topk:x): the ratio (x) is not a number"),
    ("ps-trainer", ["--compress", "topk:0.1", "--backend", "local"],
     "ps-trainer: error: --compress (topk:0.1) applies to --backend ps only, not local"),
])
def test_a_bad_compress_flag_is_one_line_with_a_hint_before_starting_anything(prog, flags, message, tmp_path,
                                                                              capsys):
    if prog == "ps-cluster":
        main = lambda: cluster.main(flags + ["--run-dir", str(tmp_path / "run")])  # noqa: E731
    else:
        main = lambda: cli.main(["--ps", "127.0.0.1:1", *flags])  # noqa: E731
    with pytest.raises(SystemExit) as e:
        cli.run_cli(prog, main)
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and "Traceback" not in err
    assert "e.g. topk:0.01" in err or "--backend" in flags  # the hint: what a good value looks like
    assert not (tmp_path / "run").exists()  # no run folder, no process


def test_compress_combines_with_pushing_during_backward():
    cfg = TrainConfig(ps="127.0.0.1:1", compress="topk:0.01", push_during_backward=True)
    assert cfg.compress == "topk:0.01"  # accepted: each shard's slice is compressed when its push starts
