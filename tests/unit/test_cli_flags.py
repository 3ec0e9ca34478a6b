"""The CLIs refuse nonsense before anything starts, read only their own environment variables, never
abbreviate flags, share the cores between trainers, and report what happened without misleading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from psserver.cli import build_parser as server_parser
from psserver.common.cli_support import EnvArgumentParser
from trainer.local import cluster
from trainer.running.cli import build_parser as trainer_parser
from trainer.running.cli import config_from_args
from trainer.running.loop import TrainConfig, default_threads


def trainer_config(*argv: str) -> TrainConfig:
    return config_from_args(trainer_parser().parse_args(["--ps", "127.0.0.1:7000", *argv]))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-5"], "--steps (-5) must be zero (use --epochs) or more"),
    (["--epochs", "0"], "give --epochs >= 1 or --steps >= 1 (got 0 and 0)"),
    (["--eval-every", "-1"], "--eval-every (-1) must be zero (each epoch only) or more"),
    (["--log-every", "0"], "--log-every (0) must be at least 1"),
    (["--overlap"], "--overlap applies to --mode async only, not sync"),
    (["--lr", "-1"], "The learning rate (-1.0) must be greater than zero"),
    (["--save-every", "10"], "--save-every (10) needs --output"),
    (["--rank", "2", "--num-trainers", "2"], "--rank (2) must be between 0 and --num-trainers - 1 (1)"),
    (["--connect-timeout", "0"], "--connect-timeout (0.0) must be more than zero seconds"),
    (["--refused-timeout", "0"], "--refused-timeout (0.0) must be more than zero seconds"),
    (["--refused-timeout", "nan"], "--refused-timeout (nan) must be more than zero seconds"),
    (["--optimizer", "adam", "--nesterov"], "--nesterov applies to --optimizer sgd only, not adam"),
    (["--push-window", "4"], "--push-window 4 applies to --mode async (or --embedding-mode async) only, not sync"),
    (["--push-window", "4", "--mode", "stale-timeout", "--sync-timeout", "1"],
     "--push-window 4 applies to --mode async (or --embedding-mode async) only, not stale-timeout"),
    (["--push-window", "0", "--mode", "async"], "--push-window (0) must be 1 to 64 pushes in flight"),
    (["--push-window", "4", "--mode", "async", "--max-staleness", "2"],
     "--push-window 4 with --max-staleness 2: this trainer's own pushes in flight alone make a push 3 versions "
     "stale; use at most --push-window 3"),
    (["--push-window", "4", "--mode", "async", "--overlap"], "--push-window 4 does not go with --overlap"),
])
def test_a_bad_trainer_flag_is_refused_naming_the_flag_and_its_value(argv, message):
    with pytest.raises(ValueError) as e:
        trainer_config(*argv)
    assert message in str(e.value)


def test_an_async_push_window_within_the_staleness_bound_is_accepted_and_its_default_lr_counts_the_window():
    cfg = trainer_config("--push-window", "3", "--mode", "async", "--max-staleness", "2", "--num-trainers", "2")
    assert cfg.push_window == 3 and cfg.optimizer_config().lr == pytest.approx(0.05 / 6)


def test_a_push_window_beside_sync_dense_layers_is_accepted_for_async_embeddings():
    cfg = trainer_config("--push-window", "4", "--embedding-mode", "async", "--dataset", "movielens100k")
    same = trainer_config("--embedding-mode", "async", "--dataset", "movielens100k")
    assert cfg.push_window == 4 and cfg.optimizer_config().lr == same.optimizer_config().lr  # the dense round is sync


def test_a_knob_of_another_mode_is_named_as_ignored_and_left_out_of_the_job():
    from trainer.running.loop import ignored_flags

    cfg = trainer_config("--sync-timeout", "1", "--max-staleness", "3", "--stale-policy", "scale")
    assert ignored_flags(cfg) == [
        "--sync-timeout (1.0) applies to --mode stale-timeout only, not sync: ignored",
        "--stale-policy (scale) applies to --mode stale-timeout only, not sync: ignored",
        "--max-staleness (3) applies to --mode async only, not sync: ignored"]
    assert ignored_flags(trainer_config("--mode", "stale-timeout", "--sync-timeout", "1")) == []


def test_flags_that_fit_together_are_accepted():
    cfg = trainer_config("--mode", "stale-timeout", "--sync-timeout", "0.5", "--stale-policy", "scale",
                         "--steps", "10", "--output", "m.pt", "--save-every", "5")
    assert (cfg.mode, cfg.sync_timeout, cfg.save_every) == ("stale-timeout", 0.5, 5)


@pytest.mark.parametrize("parser", [trainer_parser, server_parser, cluster.build_parser])
def test_a_flag_is_never_abbreviated(parser, capsys):
    flag = {"ps-trainer": "--num-trainer", "ps-server": "--checkpoint-ever", "ps-cluster": "--trainer"}
    p = parser()
    with pytest.raises(SystemExit) as e:
        required = {"ps-trainer": ["--ps", "x:1"], "ps-server": ["--shard", "0"], "ps-cluster": []}[p.prog]
        p.parse_args([*required, flag[p.prog], "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and "hint:" in err and "Traceback" not in err


def test_each_cli_reads_its_own_environment_variables(monkeypatch):
    monkeypatch.setenv("PS_TRAINER_BATCH_SIZE", "7")
    monkeypatch.setenv("PS_CLUSTER_BATCH_SIZE", "9")
    assert trainer_parser().parse_args(["--ps", "x:1"]).batch_size == 7
    assert cluster.build_parser().parse_args([]).batch_size == 9


def test_a_variable_meant_for_the_trainer_does_not_reach_other_clis(monkeypatch):
    monkeypatch.setenv("PS_OUTPUT", "elsewhere.png")  # the old name, read by ps-trainer only
    monkeypatch.setenv("PS_TRAINER_SEED", "5")
    assert cluster.build_parser().parse_args([]).seed == 0
    plot = EnvArgumentParser(prog="ps-plot")  # as ps-plot declares its image path
    plot.add_argument("-o", "--output", default="comparison.png")
    assert plot.parse_args([]).output == "comparison.png"
    assert trainer_parser().parse_args(["--ps", "x:1"]).output == "elsewhere.png"


def test_an_old_variable_name_still_works_with_a_deprecation_warning(monkeypatch, capsys):
    monkeypatch.setenv("PS_BATCH_SIZE", "11")
    assert trainer_parser().parse_args(["--ps", "x:1"]).batch_size == 11
    assert "PS_BATCH_SIZE is deprecated; use PS_TRAINER_BATCH_SIZE" in capsys.readouterr().err
    monkeypatch.setenv("PS_TRAINER_BATCH_SIZE", "12")  # the new name wins, and no warning
    assert trainer_parser().parse_args(["--ps", "x:1"]).batch_size == 12
    assert "deprecated" not in capsys.readouterr().err


@pytest.mark.parametrize("ps, trainers, local, cores, expected", [
    ("127.0.0.1:1,127.0.0.1:2", 2, "", 4, 2),  # a one-host job: the cores shared by its trainers
    ("localhost:1", 3, "", 2, 1),  # never fewer than one thread
    ("127.0.0.1:1", 1, "", 8, 0),  # alone: torch's default
    ("10.0.0.5:7000", 4, "", 8, 0),  # shards elsewhere: the trainers' hosts are unknown
    ("10.0.0.5:7000", 4, "2", 8, 4),  # torchrun's LOCAL_WORLD_SIZE says two share this host
])
def test_threads_default_to_the_cores_divided_by_the_trainers_on_this_host(monkeypatch, ps, trainers, local,
                                                                          cores, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    cfg = TrainConfig(ps=ps, num_trainers=trainers)
    assert default_threads(cfg, cores=cores) == expected


def test_ps_cluster_refuses_a_bad_flag_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="learning rate"):
        cluster.main(["--lr", "-1", "--run-dir", str(run_dir)])
    assert not run_dir.exists()  # no process started, no folder made


def summary(mode: str) -> dict:
    args = SimpleNamespace(mode=mode, model="cnn", dataset="mnist5k", shards=2, trainers=2, straggler_delay=0.0)
    stats = [SimpleNamespace(version=40, counters={"rounds_all_arrived": 40.0, "pushes_applied": 80.0})]
    progress = SimpleNamespace(latest=[{"event": "done", "test_accuracy": 0.9, "samples_per_sec": 10.0,
                                        "steps": 40, "stale_pushes": 4, "stale_steps": 2}])
    return cluster.summarize(args, "run", progress, stats, {}, 1.0)


def test_the_async_summary_reports_applied_gradients_not_rounds(capsys):
    s = summary("async")
    assert s["rounds_by_reason"] is None and s["pushes_applied"] == 80
    cluster.print_summary(s)
    out = capsys.readouterr().out
    assert "rounds closed by" not in out and "gradients applied (all shards)  80" in out
    assert "2 trainer steps had one" in out  # stale steps, not stale shard pushes
    cluster.print_summary(summary("sync"))
    assert "rounds closed by" in capsys.readouterr().out


def test_the_summary_shows_every_trainers_final_accuracy_when_a_straggler_ends_apart_from_rank_0(capsys):
    args = SimpleNamespace(mode="stale-timeout", model="cnn", dataset="mnist5k", shards=2, trainers=2,
                           straggler_delay=0.5)
    stats = [SimpleNamespace(version=40, counters={"rounds_timeout": 40.0})]
    progress = SimpleNamespace(latest=[{"event": "done", "test_accuracy": 0.944, "steps": 40},
                                       {"event": "done", "test_accuracy": 0.955, "steps": 40}])
    cluster.print_summary(cluster.summarize(args, "run", progress, stats, {}, 1.0))
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert any(x.startswith("test accuracy (rank 0)") and x.endswith(" 0.9440") for x in lines)
    assert any(x.startswith("test accuracy (by rank)") and x.endswith(" 0.9440, 0.9550") for x in lines)
    cluster.print_summary(summary("sync"))  # one trainer (or all equal): no such row
    assert "by rank" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--mode", "async", "--max-staleness", "-3"], "The maximum staleness (-3) must be between 0"),
    (["--mode", "stale-timeout"], "stale-timeout mode needs a sync timeout > 0 seconds (got 0.0)"),
    (["--mode", "stale-timeout", "--sync-timeout", "1", "--num-trainers", "2", "--replicas-to-aggregate", "5"],
     "The replicas to aggregate (5) must be between 0 and the number of trainers (2)"),
    (["--num-trainers", "0"], "--num-trainers (0) must be at least 1"),
])
def test_job_settings_are_refused_by_the_job_specs_rules_before_anything_starts(argv, message):
    with pytest.raises(ValueError) as e:
        trainer_config(*argv)
    assert message in str(e.value)


def test_a_bad_choice_from_the_environment_is_refused_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("PS_TRAINER_WIRE_DTYPE", "fp8")
    with pytest.raises(SystemExit) as e:
        trainer_parser().parse_args(["--ps", "x:1"])
    assert e.value.code == 2
    assert "environment variable PS_TRAINER_WIRE_DTYPE: invalid choice 'fp8' for --wire-dtype" in capsys.readouterr().err


def test_metrics_records_carry_null_for_a_diverged_loss_never_nan(tmp_path):
    from trainer.running.loop import MetricsWriter

    path = tmp_path / "m.jsonl"
    w = MetricsWriter(str(path), rank=0)
    w.write("step", loss=float("nan"), versions=[1, float("inf")], nested={"x": float("-inf"), "y": 1.5})
    w.close()
    record = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} written"))
    assert record["loss"] is None and record["versions"] == [1, None] and record["nested"] == {"x": None, "y": 1.5}


def test_a_run_ending_inside_an_epoch_evaluates_its_last_step_once_and_counts_no_partial_epoch(tmp_path):
    from trainer.running.loop import train

    metrics = tmp_path / "m.jsonl"
    threads = torch.get_num_threads()  # train() sets the process's thread count: leave it as it was
    try:
        summary = train(TrainConfig(ps="127.0.0.1:1", backend="local", model="mlp", dataset="synthetic", steps=6,
                                    eval_every=3, batch_size=32, metrics_file=str(metrics), threads=1,
                                    progress=False))
    finally:
        torch.set_num_threads(threads)
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "eval"]
    assert [(e["step"], e["end_of_epoch"]) for e in evals] == [(3, False), (6, False)]
    assert summary["epochs"] == 0 and summary["steps"] == 6 and summary["test_accuracy_step"] == 6


@pytest.mark.parametrize("field, value, message", [
    ("lease_timeout", -1.0, "The lease timeout (-1.0 s) must be zero (never) or more seconds"),
    ("join_timeout", -1.0, "The join timeout (-1.0 s) must be between 0 (the default: 3 s, or the lease if shorter)"),
    ("join_timeout", float("nan"), "The join timeout (nan s) must be between 0"),
    ("checkpoint_every", 0, "The checkpoint interval (0 versions) must be at least 1"),
    ("handoff_timeout", 0.0, "the hand-off timeout is 0 s but it must be more than 0 and at most 600 s"),
    ("handoff_timeout", float("nan"), "the hand-off timeout is nan s but it must be more than 0"),
    ("health_port", 99999, "The health port (99999) must be between 0 and 65535 (or -1: none)"),
    ("torch_threads", -2, "The torch threads (-2) must be zero (torch's default) or more"),
])
def test_a_bad_server_setting_is_refused_before_the_shard_starts(field, value, message):
    from psserver.serving.server import ServerConfig

    with pytest.raises(ValueError) as e:
        ServerConfig(shard=0, **{field: value})
    assert message in str(e.value)


@pytest.mark.parametrize("argv, named", [
    (["--mode", "sync", "--sync-timeout", "1"], "--sync-timeout (1.0) applies to --mode stale-timeout only, not sync"),
    (["--mode", "async", "--stale-policy", "scale"], "--stale-policy (scale) applies to --mode stale-timeout only"),
    (["--mode", "sync", "--max-staleness", "2"], "--max-staleness (2) applies to --mode async only, not sync"),
])
def test_ps_cluster_names_a_knob_of_another_mode_in_a_warning_and_passes_it_on_to_no_trainer(argv, named):
    args = cluster.build_parser().parse_args(argv)
    assert [n for n in cluster.ignored_knobs(args) if named in n]
    flag = named.split()[0]
    assert flag not in cluster.trainer_args(args, 0, Path("/tmp/run"))


def test_ps_cluster_warns_of_nothing_when_the_knobs_fit_the_mode_and_stale_timeout_keeps_its_default_timeout():
    assert cluster.ignored_knobs(cluster.build_parser().parse_args(["--mode", "sync"])) == []
    args = cluster.build_parser().parse_args(["--mode", "stale-timeout"])
    assert cluster.ignored_knobs(args) == []
    argv = cluster.trainer_args(args, 0, Path("/tmp/run"))
    assert argv[argv.index("--sync-timeout") + 1] == str(cluster.DEFAULT_SYNC_TIMEOUT)


@pytest.mark.parametrize("value", ["0", "-1", "601", "1e9", "nan", "inf"])
def test_ps_server_refuses_a_handoff_timeout_outside_0_to_600_seconds_in_one_line_with_a_hint(value, capsys):
    from psserver import cli as server_cli

    with pytest.raises(SystemExit) as e:
        server_cli.main(["--shard", "0", "--handoff-timeout", value])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ps-server: error:")]
    assert e.value.code == 2 and len(errors) == 1
    err = errors[0]
    assert err.startswith("ps-server: error: --handoff-timeout: the hand-off timeout is")
    assert "must be more than 0 and at most 600 s" in err and "hint:" in err


def test_ps_server_handoff_timeout_defaults_to_the_joins_3_s_and_takes_a_larger_one():
    from psserver import cli as server_cli

    parser = server_cli.build_parser()
    assert parser.parse_args(["--shard", "0"]).handoff_timeout == 3.0
    assert parser.parse_args(["--shard", "0", "--handoff-timeout", "10"]).handoff_timeout == 10.0


@pytest.mark.parametrize("argv, cause", [
    (["--join-timeout", "-1"], "The join timeout (-1.0 s) must be between 0"),
    (["--join-timeout", "nan"], "The join timeout (nan s) must be between 0"),
    (["--lease-timeout", "-2"], "The lease timeout (-2.0 s) must be zero (never) or more seconds"),
    (["--checkpoint-every", "0"], "The checkpoint interval (0 versions) must be at least 1"),
    (["--stream-idle-timeout", "0"], "The stream idle timeout (0.0 s) must be between 0 and"),
    (["--max-calls-per-peer", "0"], "The max calls per peer (0) must be at least 1"),
    (["--port", "70000"], "The port (70000) must be between 0 and 65535"),
], ids=["join-timeout", "join-timeout-nan", "lease-timeout", "checkpoint-every", "stream-idle-timeout",
        "max-calls-per-peer", "port"])
def test_ps_server_refuses_a_value_only_its_config_checks_as_argparse_would_exit_2_one_line_and_a_hint(
        argv, cause, capsys):
    from psserver import cli as server_cli

    with pytest.raises(SystemExit) as e:
        server_cli.main(["--shard", "0", *argv])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err[0].startswith(f"ps-server: error: {cause}"), err
    assert err[1:] == ["hint: run 'ps-server --help' for the flags"]


def test_ps_server_run_with_a_bad_join_timeout_prints_one_error_line_and_a_hint_and_no_traceback():
    """The real command line (its entrypoint, run_cli), as a user runs it: not a Python traceback."""
    env = {**os.environ, "GLIBC_TUNABLES": "", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", "from psserver.cli import entrypoint; entrypoint()", "--shard", "0",
                           "--join-timeout", "-1"], capture_output=True, text=True, env=env, timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line.split(":")[0] for line in lines] == ["ps-server", "hint"], proc.stderr
    assert lines[0].startswith("ps-server: error: The join timeout (-1.0 s) must be between 0")


@pytest.mark.parametrize("module", ["psserver.cli", "trainer.running.cli", "trainer.local.cluster"])
def test_every_flag_says_what_it_does_in_its_help(module):
    """(--shards, --trainers, --epochs, --seed and --dataset had no help text: `-h` listed them bare.)"""
    import argparse
    import importlib

    parser = importlib.import_module(module).build_parser()
    bare = [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.help in (None, "") and a.help != argparse.SUPPRESS]
    assert bare == []


@pytest.mark.parametrize("module", ["psserver.cli", "trainer.running.cli", "trainer.local.cluster"])
def test_every_flag_has_help_text_and_shows_its_default(module):
    """What --help prints for each flag of ps-server (its subcommands too), ps-trainer and ps-cluster: a line of
    help beyond the environment variable it reads, and the default wherever there is one (switches aside)."""
    import argparse
    import importlib

    def flags(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from flags(sub)
            elif action.option_strings and action.dest != "help":
                yield parser.prog, action

    seen = 0
    for prog, action in flags(importlib.import_module(module).build_parser()):
        seen += 1
        text = (action.help or "").split(" [env ")[0].strip()
        assert text and not text.startswith("(default"), (prog, action.option_strings)
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not switch and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in text, (prog, action.option_strings, action.default)
    assert seen > 10
