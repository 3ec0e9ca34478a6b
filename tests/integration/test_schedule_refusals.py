"""A schedule over real gRPC: bad ones refused at Register, a different one named, the rate in GetStats."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.schedules import LrSchedule, lr_at
from tests.conftest import P, make_spec
from tests.helpers import refused

SCHEDULE = LrSchedule(kind="cosine", cosine_steps=10, min_lr=0.05, warmup_steps=2)


@pytest.mark.parametrize("field,value,fragment", [
    ("gamma", 2.0, "The lr_schedule.gamma (2.0) must be greater than 0 and at most 1."),
    ("kind", "exp", "The lr_schedule.kind ('exp') must be one of constant, step, cosine."),
    ("warmup_steps", 1 << 60, f"The lr_schedule.warmup_steps ({1 << 60}) must be between 0 and"),
    ("min_lr", 0.75, "The lr_schedule.min_lr (0.75) must be at most the learning rate (0.5)."),
])
def test_register_refuses_a_bad_schedule_naming_the_field_and_fixes_no_job(shard_server, field, value, fragment):
    shard = shard_server()
    msg = make_spec(lr_schedule=SCHEDULE).to_proto()
    setattr(msg.lr_schedule, field, value)
    req = pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=0, job=msg)
    refused(lambda: shard.stub.Register(req, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    stats = shard.stats()
    assert (stats.mode, stats.lr, list(stats.live_ranks)) == ("", 0.0, [])
    assert shard.register(spec=make_spec(lr_schedule=SCHEDULE)).registered == 1  # a good one still fixes the job


def test_a_trainer_with_another_schedule_is_refused_naming_both(shard_server):
    shard = shard_server()
    shard.register(rank=0, spec=make_spec(num_trainers=2, lr_schedule=SCHEDULE))
    other = make_spec(num_trainers=2, lr_schedule=dataclasses.replace(SCHEDULE, cosine_steps=20))
    refused(lambda: shard.register(rank=1, spec=other), grpc.StatusCode.FAILED_PRECONDITION,
            "lr_schedule.cosine_steps is 20 but the job has 10")
    assert list(shard.stats().live_ranks) == [0]


def test_getstats_reports_the_rate_of_the_next_step(shard_server):
    shard = shard_server()
    shard.register(spec=make_spec(lr_schedule=SCHEDULE))
    shard.init(torch.zeros(P))
    for v in range(4):
        assert shard.stats().lr == lr_at(SCHEDULE, 0.5, v)
        assert shard.push(torch.ones(P), version=v).outcome == pb.APPLIED
    assert shard.stats().version == 4 and shard.stats().lr == lr_at(SCHEDULE, 0.5, 4) < 0.5
