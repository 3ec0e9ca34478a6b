"""--device: which GPU a trainer takes, and the one-line refusals (the GPU count is injected: no GPU needed)."""

import pytest
import torch

from trainer.running import cli as trainer_cli
from trainer.local.cluster import trainer_env
from trainer.running.loop import TrainConfig, device_problem, local_rank, pick_device

LOOPBACK2 = "127.0.0.1:1,127.0.0.1:2"


@pytest.mark.parametrize("local, count, expected", [(0, 2, "cuda:0"), (1, 2, "cuda:1"), (3, 2, "cuda:1"),
                                                    (2, 1, "cuda:0"), (5, 4, "cuda:1")])
def test_auto_and_cuda_take_the_local_rank_modulo_the_visible_gpus(local, count, expected):
    assert pick_device("auto", local, count) == torch.device(expected)
    assert pick_device("cuda", local, count) == torch.device(expected)


def test_auto_falls_back_to_the_cpu_without_a_gpu():
    assert pick_device("auto", 3, 0) == torch.device("cpu")


def test_cpu_stays_on_the_cpu_when_gpus_are_visible():
    assert pick_device("cpu", 1, 4) == torch.device("cpu")


def test_an_explicit_gpu_is_taken_whatever_the_local_rank():
    assert pick_device("cuda:1", 0, 2) == torch.device("cuda:1")


def test_a_gpu_index_past_the_visible_count_is_refused_naming_both():
    with pytest.raises(ValueError) as e:
        pick_device("cuda:2", 0, 2)
    message = str(e.value)
    assert "cuda:2" in message and "2 are visible" in message and "cuda:0 to cuda:1" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused_with_a_hint(name):
    assert "no CUDA device is visible; use --device auto or cpu" in device_problem(name, 0)


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "cuda:-1", "mps"])
def test_an_unknown_device_name_is_refused_listing_the_choices(name):
    assert device_problem(name, 2) == f"--device ({name}) must be auto, cpu, cuda or cuda:N"


def test_local_rank_comes_from_LOCAL_RANK_first():
    cfg = TrainConfig(ps=LOOPBACK2, rank=1, num_trainers=2)
    assert local_rank(cfg, {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2"}) == 5


def test_local_rank_is_the_rank_modulo_LOCAL_WORLD_SIZE():
    cfg = TrainConfig(ps="10.0.0.1:1", rank=5, num_trainers=8)
    assert local_rank(cfg, {"LOCAL_WORLD_SIZE": "4"}) == 1


def test_local_rank_is_the_rank_in_a_one_machine_job_and_zero_otherwise():
    assert local_rank(TrainConfig(ps=LOOPBACK2, rank=1, num_trainers=2), {}) == 1
    assert local_rank(TrainConfig(ps="10.0.0.1:1", rank=1, num_trainers=2), {}) == 0


def test_ps_cluster_gives_each_trainer_its_own_local_rank():
    envs = [trainer_env(r, 3) for r in range(3)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"] and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert [pick_device("auto", int(e["LOCAL_RANK"]), 2) for e in envs] == [torch.device(d) for d in
                                                                          ("cuda:0", "cuda:1", "cuda:0")]


def test_the_trainer_cli_refuses_a_missing_gpu_before_anything_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = trainer_cli.build_parser().parse_args(["--ps", LOOPBACK2, "--device", "cuda:1"])
    with pytest.raises(ValueError, match=r"--device cuda:1 names GPU 1 but 1 is visible \(cuda:0 to cuda:0\)"):
        trainer_cli.config_from_args(args)
    args = trainer_cli.build_parser().parse_args(["--ps", LOOPBACK2, "--device", "cuda:0"])
    assert trainer_cli.config_from_args(args).device == "cuda:0"


@pytest.mark.parametrize("device, gpus", [("cpu", 1), ("auto", 0)])
def test_the_ddp_nccl_baseline_without_a_gpu_is_refused_pointing_to_gloo(monkeypatch, device, gpus):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = trainer_cli.build_parser().parse_args(["--ps", "127.0.0.1:1", "--backend", "ddp-nccl", "--device", device])
    with pytest.raises(ValueError, match=rf"--backend ddp-nccl needs a GPU \(--device {device}, {gpus} visible\); "
                                         r"use --backend ddp \(gloo\)"):
        trainer_cli.config_from_args(args)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = trainer_cli.build_parser().parse_args(["--ps", "127.0.0.1:1", "--backend", "ddp-nccl", "--device", "cuda"])
    assert trainer_cli.config_from_args(args).backend == "ddp-nccl"
