"""ps-trainer / ps-cluster on MovieLens-100k: flags checked before anything starts, defaults, RMSE reported."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from trainer.local import cluster
from trainer.running.cli import build_parser as trainer_parser
from trainer.running.cli import config_from_args
from trainer.running.loop import TrainConfig, effective_lr, train

ML = ("--dataset", "movielens100k")


def trainer_config(*argv: str) -> TrainConfig:
    return config_from_args(trainer_parser().parse_args(["--ps", "127.0.0.1:7000", *argv]))


@pytest.mark.parametrize("argv, message", [
    ([*ML, "--model", "cnn"], "--model cnn does not fit --dataset movielens100k: choose one of mf, ncf"),
    (["--model", "mf"], "--model mf is a recommender model: it needs --dataset movielens100k, not --dataset mnist5k"),
    (["--embedding-dim", "8"],
     "--embedding-dim applies to --dataset movielens100k or criteo-synth only, not --dataset mnist5k"),
    (["--embedding-mode", "async"], "--embedding-mode applies to --dataset movielens100k or criteo-synth only"),
    ([*ML, "--embedding-dim", "0"], "--embedding-dim (0) must be at least 1"),
    ([*ML, "--sparse-lr", "0"], "--sparse-lr (0.0) must be more than zero"),
    ([*ML, "--sparse-lr", "nan"], "--sparse-lr (nan) must be more than zero"),
    ([*ML, "--admit-after", "-1"], "--admit-after (-1) must be zero (store every row) or more"),
    ([*ML, "--max-rows", "0"], "--max-rows (0) must be at least 1"),
    ([*ML, "--embedding-mode", "stale-timeout"], "--embedding-mode stale-timeout needs --mode stale-timeout"),
    ([*ML, "--backend", "ddp"], "--backend ddp cannot train the tables of --dataset movielens100k"),
])
def test_a_recommender_flag_mistake_is_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError) as e:
        trainer_config(*argv)
    assert message in str(e.value)


def test_movielens_defaults_are_the_single_process_baselines_split_over_the_trainers():
    cfg = trainer_config(*ML, "--num-trainers", "2", "--rank", "1")
    assert (cfg.model, cfg.optimizer, cfg.batch_size, effective_lr(cfg)) == ("mf", "adam", 512, 0.001)
    sparse = cfg.sparse_optimizer_config()
    assert (sparse.name, sparse.lr, cfg.embedding_mode, cfg.admit_after, cfg.max_rows) == ("adam", 0.01, "", 0, None)
    image = trainer_config()
    assert (image.model, image.optimizer, image.batch_size, effective_lr(image)) == ("cnn", "sgd", 32, 0.05)


def test_the_async_embeddings_recipe_and_table_flags_reach_the_config():
    cfg = trainer_config(*ML, "--model", "ncf", "--embedding-mode", "async", "--sparse-optimizer", "rowwise_adagrad",
                         "--sparse-lr", "0.05", "--embedding-dim", "16", "--admit-after", "2", "--max-rows", "500")
    assert (cfg.mode, cfg.embedding_mode, cfg.embedding_dim, cfg.admit_after, cfg.max_rows) == \
        ("sync", "async", 16, 2, 500)
    assert cfg.sparse_optimizer_config().name == "rowwise_adagrad"


def test_ps_cluster_passes_the_dataset_and_table_flags_and_leaves_the_rest_to_the_trainers_defaults(tmp_path):
    args = cluster.build_parser().parse_args([*ML, "--trainers", "2", "--embedding-mode", "async", "--max-rows", "9"])
    argv = cluster.trainer_args(args, 0, tmp_path)
    assert "--batch-size" not in argv and "--optimizer" not in argv
    cfg = trainer_config("--rank", "0", *argv)
    assert (cfg.dataset, cfg.batch_size, cfg.embedding_mode, cfg.max_rows, cfg.num_trainers) == \
        ("movielens100k", 512, "async", 9, 2)


def test_ps_cluster_refuses_a_model_that_does_not_fit_the_dataset_before_starting_anything(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="--model cnn does not fit --dataset movielens100k"):
        cluster.main([*ML, "--model", "cnn", "--run-dir", str(run)])
    assert not run.exists()


def test_ps_trainer_reports_the_mistake_in_one_line_and_a_hint_without_a_traceback():
    proc = subprocess.run([sys.executable, "-c", "from trainer.running.cli import entrypoint; entrypoint()", "--ps",
                           "127.0.0.1:1", *ML, "--model", "resnet18"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-2] == "ps-trainer: error: --model resnet18 does not fit --dataset movielens100k: choose one of mf, ncf"
    assert lines[-1].startswith("hint: ") and "Traceback" not in proc.stderr


def test_ps_cluster_summary_shows_the_test_rmse_instead_of_accuracy(tmp_path, capsys):
    args = cluster.build_parser().parse_args([*ML])
    args.model = "mf"
    progress = type("P", (), {"latest": [{"event": "done", "test_accuracy": None, "test_rmse": 0.91234,
                                          "samples_per_sec": 10.0, "steps": 3}]})()
    summary = cluster.summarize(args, tmp_path, progress, [None], {}, 1.0)
    assert summary["test_rmse"] == 0.91234
    cluster.print_summary(summary)
    out = capsys.readouterr().out
    assert "test RMSE (rank 0)" in out and "0.9123" in out and "accuracy" not in out


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_local_run_writes_the_test_rmse_each_evaluation_and_in_the_summary(tmp_path, one_thread):
    """--backend local keeps the tables on LocalRows: the whole loop without shards."""
    metrics = tmp_path / "m.jsonl"
    cfg = TrainConfig(ps="127.0.0.1:1", backend="local", dataset="movielens100k", model="mf", optimizer="adam",
                      batch_size=1024, steps=24, eval_every=12, metrics_file=str(metrics), progress=False)
    summary = train(cfg)
    evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"eval"' in line]
    rmses = [e["test_rmse"] for e in evals]
    assert [e["step"] for e in evals] == [12, 24] and "test_accuracy" not in evals[0]
    assert summary["test_rmse"] == rmses[-1] and summary["test_accuracy"] is None
    assert rmses[1] < rmses[0] < 1.2 and math.isfinite(summary["final_loss"])
