"""Every stepper the training loop can be given offers the whole trainer.stepping.stepper.Stepper protocol."""

import torch

from psserver.protocol.job import OptimizerConfig
from trainer.workloads.baselines import LocalStepper, LocalTables
from trainer.stepping.stepper import Stepper

METHODS = ("prepare_step", "take_forward_wait", "step", "flush", "close", "leave_outcome")


def test_the_local_baseline_is_a_stepper_with_nothing_to_wait_for_or_leave():
    local = LocalStepper(torch.nn.Linear(2, 1), OptimizerConfig())
    assert isinstance(local, Stepper)
    assert local.take_forward_wait() == 0.0 and local.left
    assert local.leave_outcome() == "no shards to leave (the local baseline)"


def test_the_local_tables_baseline_delegates_the_protocol_to_its_inner_stepper():
    from trainer.tables.embedding import ShardedEmbedding

    model = torch.nn.Sequential(ShardedEmbedding("users", 2, num_embeddings=4))
    wrapped = LocalTables(LocalStepper(torch.nn.Linear(2, 1), OptimizerConfig()), model)
    assert isinstance(wrapped, Stepper)
    assert wrapped.versions is wrapped.inner.versions and wrapped.counters is wrapped.inner.counters
    assert "tables on LocalRows" in wrapped.describe


def test_the_parameter_server_trainer_has_every_method_of_the_protocol():
    from trainer.stepping.api import ParameterServerTrainer

    assert [m for m in METHODS if not callable(getattr(ParameterServerTrainer, m, None))] == []
