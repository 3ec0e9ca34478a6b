"""RANK and WORLD_SIZE, as torchrun sets them, stand in for ps-trainer's --rank / --num-trainers and connect()'s
rank / num_trainers when those are not given; a value given wins; a bad variable is refused naming it."""

from __future__ import annotations

import pytest
import torch

from trainer.stepping import api
from trainer.running.cli import build_parser, config_from_args
from trainer.membership.torchrun import rank_and_world

FLAGS = ("--rank", "--num-trainers")


def trainer_config(env: dict, *argv: str):
    return config_from_args(build_parser().parse_args(["--ps", "127.0.0.1:7000", *argv]), env=env)


def test_ps_trainer_takes_rank_and_world_size_from_the_environment():
    cfg = trainer_config({"RANK": "1", "WORLD_SIZE": "3"})
    assert (cfg.rank, cfg.num_trainers) == (1, 3)


def test_ps_trainer_without_flags_or_variables_is_rank_0_of_1():
    cfg = trainer_config({})
    assert (cfg.rank, cfg.num_trainers) == (0, 1)


def test_ps_trainer_flags_win_over_the_environment():
    cfg = trainer_config({"RANK": "1", "WORLD_SIZE": "3"}, "--rank", "0", "--num-trainers", "2")
    assert (cfg.rank, cfg.num_trainers) == (0, 2)


def test_a_malformed_variable_is_ignored_when_its_flag_is_given():
    cfg = trainer_config({"RANK": "first"}, "--rank", "0")
    assert cfg.rank == 0


@pytest.mark.parametrize("env, argv, message", [
    ({"RANK": "first"}, [], "RANK ('first') must be a whole number of at least 0"),
    ({"RANK": "-1"}, [], "RANK ('-1') must be a whole number of at least 0"),
    ({"WORLD_SIZE": "0"}, [], "WORLD_SIZE ('0') must be a whole number of at least 1"),
    ({"WORLD_SIZE": "two"}, [], "WORLD_SIZE ('two') must be a whole number of at least 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, [], "RANK (2) must be below WORLD_SIZE (2)"),
    ({"RANK": "3"}, ["--num-trainers", "2"], "RANK (3) must be below --num-trainers (2)"),
    ({"WORLD_SIZE": "2"}, ["--rank", "2"], "--rank (2) must be below WORLD_SIZE (2)"),
])
def test_a_bad_or_conflicting_variable_is_refused_in_one_line_naming_it_and_its_value(env, argv, message):
    with pytest.raises(ValueError) as e:
        trainer_config(env, *argv)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "torchrun" in str(e.value)  # the hint: where such variables come from


def test_connect_takes_rank_and_world_size_from_the_environment(monkeypatch):
    seen = {}

    class Captured(Exception):
        pass

    def capture(addresses, model, job, rank, *args, **kwargs):
        seen.update(rank=rank, num_trainers=job.num_trainers)
        raise Captured  # stop before any shard is called
    monkeypatch.setattr(api, "ParameterServerTrainer", capture)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Captured):
        api.connect("127.0.0.1:1", torch.nn.Linear(2, 1))
    assert seen == {"rank": 1, "num_trainers": 2}
    with pytest.raises(Captured):
        api.connect("127.0.0.1:1", torch.nn.Linear(2, 1), rank=0, num_trainers=3)
    assert seen == {"rank": 0, "num_trainers": 3}


def test_connect_refuses_a_rank_outside_world_size_naming_both_variables(monkeypatch):
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK \(4\) must be below WORLD_SIZE \(2\).*pass rank and num_trainers"):
        api.connect("127.0.0.1:1", torch.nn.Linear(2, 1))


def test_rank_and_world_names_the_callers_own_settings_in_its_message():
    with pytest.raises(ValueError, match=r"--rank \(5\) must be below WORLD_SIZE \(2\)"):
        rank_and_world(5, None, FLAGS, {"WORLD_SIZE": "2"})
