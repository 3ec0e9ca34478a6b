"""Learning-rate schedules: the shard's rate at version v is torch.optim.lr_scheduler's, and a restore resumes it."""

import dataclasses
import math

import pytest
import torch
from torch.optim import lr_scheduler as L

from psserver.partition.shard import Shard
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.limits import MAX_SCHEDULE_STEPS
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.schedules import LrSchedule, lr_at
from psserver.state.checkpoint import Checkpointer
from tests.conftest import P, make_spec

FP = "f" * 16
BASE_LR = 0.5


def torch_scheduler(schedule: LrSchedule, opt: torch.optim.Optimizer):
    """The torch.optim.lr_scheduler a single-process user would write for ``schedule``."""
    s = schedule
    if s.kind == "step":
        decay = L.StepLR(opt, step_size=s.step_size, gamma=s.gamma)
    elif s.kind == "cosine":
        decay = L.CosineAnnealingLR(opt, T_max=s.cosine_steps, eta_min=s.min_lr)
    else:
        decay = L.ConstantLR(opt, factor=1.0, total_iters=0)
    if not s.warmup_steps:
        return decay
    warmup = L.LinearLR(opt, start_factor=s.warmup_start_factor, end_factor=1.0, total_iters=s.warmup_steps)
    return L.SequentialLR(opt, [warmup, decay], milestones=[s.warmup_steps])


def torch_rates(schedule: LrSchedule, base_lr: float, versions: int) -> list[float]:
    """The rate torch's optimizer uses at each of its first ``versions`` steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = torch_scheduler(schedule, opt)
    rates = []
    for _ in range(versions):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


SCHEDULES = [
    LrSchedule(),
    LrSchedule(warmup_steps=7, warmup_start_factor=0.25),
    LrSchedule(warmup_steps=1, warmup_start_factor=0.5),
    LrSchedule(kind="step", step_size=10, gamma=0.5),
    LrSchedule(kind="step", step_size=1, gamma=0.9),
    LrSchedule(kind="step", step_size=25, gamma=0.1, warmup_steps=12, warmup_start_factor=0.01),
    LrSchedule(kind="cosine", cosine_steps=100, min_lr=0.0),
    LrSchedule(kind="cosine", cosine_steps=37, min_lr=0.02),  # 300 versions: several periods, as torch's
    LrSchedule(kind="cosine", cosine_steps=200, min_lr=0.001, warmup_steps=20, warmup_start_factor=0.1),
    LrSchedule(kind="cosine", cosine_steps=1, warmup_steps=3),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.kind}-w{s.warmup_steps}")
def test_rate_at_every_version_equals_torch_lr_scheduler(schedule):
    versions = 300
    expected = torch_rates(schedule, BASE_LR, versions)
    got = [lr_at(schedule, BASE_LR, v) for v in range(versions)]
    # torch steps most schedules recursively (each rate from the last), lr_at uses the closed forms: rounding only
    for v, (a, b) in enumerate(zip(got, expected)):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12 * BASE_LR), f"version {v}: {a} vs torch {b}"
    if schedule != LrSchedule():
        assert len(set(round(x, 12) for x in expected)) > 1  # the schedule does move the rate


def test_rates_stay_finite_and_non_negative_at_the_largest_versions():
    for schedule in SCHEDULES:
        for v in (MAX_SCHEDULE_STEPS - 1, MAX_SCHEDULE_STEPS, 1 << 62):
            assert 0.0 <= lr_at(schedule, BASE_LR, v) <= BASE_LR


@pytest.mark.parametrize("change,message", [
    (dict(kind="linear"), "The lr_schedule.kind ('linear') must be one of constant, step, cosine."),
    (dict(warmup_steps=-1), "The lr_schedule.warmup_steps (-1) must be between 0 and"),
    (dict(warmup_steps=MAX_SCHEDULE_STEPS + 1), f"The lr_schedule.warmup_steps ({MAX_SCHEDULE_STEPS + 1})"),
    (dict(warmup_steps=2.5), "The lr_schedule.warmup_steps (2.5) must be a whole number."),
    (dict(warmup_start_factor=0.0), "The lr_schedule.warmup_start_factor (0.0) must be greater than 0 and at most 1."),
    (dict(warmup_start_factor=1.5), "The lr_schedule.warmup_start_factor (1.5)"),
    (dict(warmup_start_factor=math.nan), "The lr_schedule.warmup_start_factor (nan) must be a finite number."),
    (dict(step_size=0), "The lr_schedule.step_size (0) must be between 1 and"),
    (dict(gamma=0.0), "The lr_schedule.gamma (0.0) must be greater than 0 and at most 1."),
    (dict(gamma=1.01), "The lr_schedule.gamma (1.01)"),
    (dict(gamma=math.inf), "The lr_schedule.gamma (inf) must be a finite number."),
    (dict(cosine_steps=0), "The lr_schedule.cosine_steps (0) must be between 1 and"),
    (dict(min_lr=-0.1), "The lr_schedule.min_lr (-0.1) must be zero or more."),
    (dict(min_lr="0"), "The lr_schedule.min_lr ('0') must be a number."),
])
def test_invalid_schedules_are_refused_naming_the_field_and_value(change, message):
    with pytest.raises(ValueError) as e:
        LrSchedule(**change)
    assert message in str(e.value)


def test_cosine_floor_above_the_base_rate_is_refused_by_the_job_spec():
    with pytest.raises(ValueError, match=r"The lr_schedule.min_lr \(0.6\) must be at most the learning rate \(0.5\)"):
        make_spec(lr_schedule=LrSchedule(kind="cosine", cosine_steps=10, min_lr=0.6))


def test_schedule_crosses_the_wire_and_a_difference_is_named():
    spec = make_spec(lr_schedule=SCHEDULES[-2])
    assert JobSpec.from_proto(spec.to_proto()) == spec
    other = dataclasses.replace(spec, lr_schedule=dataclasses.replace(SCHEDULES[-2], warmup_steps=21))
    assert spec.difference(other) == "lr_schedule.warmup_steps is 21 but the job has 20"
    assert make_spec().difference(spec) == "lr_schedule.kind is 'cosine' but the job has 'constant'"


def test_a_spec_without_a_schedule_from_an_older_peer_is_constant():
    msg = make_spec().to_proto()
    msg.ClearField("lr_schedule")
    assert JobSpec.from_proto(msg).lr_schedule == LrSchedule()


def test_a_bad_schedule_on_the_wire_is_a_job_spec_error():
    msg = make_spec().to_proto()
    msg.lr_schedule.step_size = 0
    with pytest.raises(ValueError, match=r"The lr_schedule.step_size \(0\) must be between 1"):
        JobSpec.from_proto(msg)


# ---------------------------------------------------------------- the shard applies it

SCHEDULE = LrSchedule(kind="cosine", cosine_steps=12, min_lr=0.01, warmup_steps=4, warmup_start_factor=0.2)


def scheduled_shard(directory) -> Shard:
    spec = dataclasses.replace(make_spec(mode="async"), optimizer=OptimizerConfig("sgd", lr=BASE_LR),
                               lr_schedule=SCHEDULE)
    shard = Shard(0, checkpointer=Checkpointer(directory, shard=0, every=1000))
    shard.register(0, "t0", 0, spec)
    shard.init(0, "t0", FP, torch.zeros(P))
    return shard


def step(shard: Shard, sequence: int) -> float:
    """One push of an all-ones gradient; returns the rate the step used (plain SGD: how far it moved)."""
    before = shard.params.detach().clone()
    assert shard.push(0, "t0", FP, shard.version, 1, torch.ones(P), sequence)[0].outcome == "applied"
    used = shard.optimizer.param_groups[0]["lr"]
    assert torch.equal(shard.params.detach(), before.add(torch.ones(P), alpha=-used))
    return used


def test_shard_steps_with_torch_schedulers_rate_at_each_version(tmp_path):
    shard = scheduled_shard(tmp_path)
    expected = torch_rates(SCHEDULE, BASE_LR, 20)
    for v in range(20):
        assert math.isclose(shard.snapshot().lr, expected[v], rel_tol=1e-9)  # what GetStats and /metrics show
        assert math.isclose(step(shard, v + 1), expected[v], rel_tol=1e-9)
    assert shard.version == 20


def test_a_restored_shard_resumes_the_schedule_where_its_checkpoint_was(tmp_path):
    reference = scheduled_shard(tmp_path / "reference")
    rates = [step(reference, v + 1) for v in range(14)]

    first = scheduled_shard(tmp_path / "ck")
    for v in range(6):
        step(first, v + 1)
    first.final_checkpoint()
    restored = Shard(0, checkpointer=Checkpointer(tmp_path / "ck", shard=0, every=1000))
    assert restored.restore() == 6
    assert math.isclose(restored.snapshot().lr, rates[6], rel_tol=1e-9)
    resumed = [step(restored, v + 1) for v in range(6, 14)]
    assert resumed == rates[6:]  # not the schedule from its start, nor the rate saved in the optimizer's state
    assert rates[6] != rates[5] and rates[6] != BASE_LR * SCHEDULE.warmup_start_factor
    assert torch.equal(restored.params.detach(), reference.params.detach())


def test_stats_report_no_rate_before_a_job():
    assert Shard(0).snapshot().lr == 0.0
    assert pb.StatsReply(lr=0.25).lr == 0.25
