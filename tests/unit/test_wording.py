"""What a shard says about counts reads as English: "1 trainer", "2 trainers" (no network: a Shard object)."""

import logging

import pytest

from psserver.partition.shard import Shard
from psserver.protocol.errors import InvalidRequest, JobMismatch
from psserver.protocol.job import JobSpec


def spec(num_trainers: int, num_shards: int = 1) -> JobSpec:
    return JobSpec(mode="sync", num_trainers=num_trainers, num_shards=num_shards, total_params=10,
                   fingerprint="f" * 16, tensors=(("w", (10,), "float32"),))


def test_job_fixed_log_says_one_trainer_and_two_trainers(caplog):
    with caplog.at_level(logging.INFO, logger="psserver.partition.shard"):
        Shard(0).register(0, "t0", 0, spec(1))
        Shard(0).register(0, "t0", 0, spec(2))
    fixed = [r.getMessage() for r in caplog.records if "fixed" in r.getMessage()]
    assert len(fixed) == 2
    assert "mode sync, 1 trainer, slice" in fixed[0] and "mode sync, 2 trainers, slice" in fixed[1]


def test_refusals_count_one_trainer_and_one_shard_in_the_singular():
    with pytest.raises(InvalidRequest, match=r"the job has 1 trainer \(ranks 0\.\.0\)"):
        Shard(0).register(1, "t1", 0, spec(1))
    with pytest.raises(JobMismatch, match=r"this is shard 1 but the job has only 1 shard$"):
        Shard(1).register(0, "t0", 1, spec(1))
