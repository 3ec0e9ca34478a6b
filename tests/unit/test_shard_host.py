"""The partitions one ps-server process serves (psserver.partition.host), without a network: routing, refusals that
create nothing, leases renewed through partition 0, restore of a partitioned shard, receive buffers."""

import asyncio

import pytest
import torch

from psserver.partition.host import ShardHost
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotReady
from psserver.serving.runtime import ReceiveBuffers
from tests.conftest import P, make_spec
from tests.unit.test_shard_leases import LEASE, Clock

FP = "f" * 16


def joined(host: ShardHost, spec, rank=0, trainer_id="t0"):
    """Register ``rank`` on every partition of ``spec`` (what a trainer does at connect)."""
    for k in range(spec.partitions):
        host.part_for_register(k, rank, 0, spec).register(rank, trainer_id, 0, spec)


def test_a_register_of_a_job_with_another_partition_count_is_refused_before_any_partition_is_made(tmp_path):
    host = ShardHost(0, checkpoint_dir=str(tmp_path))
    joined(host, make_spec())
    with pytest.raises(JobMismatch, match="partitions is 4 but the job has 1"):
        host.part_for_register(1, 0, 0, make_spec(partitions=4))
    assert len(host.parts) == 1
    assert not any(p.name.startswith("partition-") for p in tmp_path.iterdir())


def test_an_empty_shard_asks_a_caller_of_another_partition_to_register_and_refuses_an_index_past_the_job():
    host = ShardHost(0)
    with pytest.raises(NotReady, match="no job yet"):  # FAILED_PRECONDITION: the trainer registers again
        host.part(2)
    joined(host, make_spec(partitions=3))
    assert host.part(2).partition == 2
    with pytest.raises(InvalidRequest, match="partition is 3 but shard 0 serves 3 partitions"):
        host.part(3)


def test_a_partition_registered_before_partition_0_serves_its_job_at_once():
    """A trainer's rejoin registers every partition in parallel: partition 1 may register and Init before
    partition 0 has fixed the job, and must then serve it, not answer "register first" again."""
    host = ShardHost(0)
    spec = make_spec(partitions=3)
    host.part_for_register(1, 0, 0, spec).register(0, "t0", 0, spec)
    assert host.head.job is None
    assert host.part(1).partition == 1 and host.part(1).job is not None
    with pytest.raises(NotReady, match="no job yet"):  # one that has not registered still asks for it
        host.part(2)


def test_partitions_of_an_ended_job_with_more_are_not_served_to_the_next():
    host = ShardHost(0)
    first = make_spec(partitions=3, job_id="a")
    joined(host, first)
    for k in range(3):
        host.parts[k].leave(0, "t0", FP)
    joined(host, make_spec(partitions=2, job_id="b"), trainer_id="t1")
    with pytest.raises(InvalidRequest, match="partition is 2 but shard 0 serves 2 partitions"):
        host.part(2)


def test_a_heartbeat_to_partition_0_keeps_the_lease_on_every_partition():
    clock = Clock()
    host = ShardHost(0, clock=clock, lease_timeout=LEASE)
    joined(host, make_spec(partitions=3))
    for _ in range(4):
        clock.now += LEASE * 0.75
        host.heartbeat(0, 0, "t0", FP)
        host.tick()
    assert all(p.members.view().live == {0} for p in host.parts)
    clock.now += LEASE * 1.5
    host.tick()
    assert all(not p.members.view().live for p in host.parts)
    assert host.snapshot().counters["lease_expired"] == 3  # one per partition


def test_a_restored_partition_whose_checkpoint_is_of_another_job_starts_empty(tmp_path):
    spec = make_spec(partitions=2, job_id="a")
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    joined(host, spec)
    for k in range(2):
        host.parts[k].init(0, "t0", FP, torch.zeros(host.parts[k].slice_length()))
    host.final_checkpoint()
    other = ShardHost(0, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=1)
    joined(other, make_spec(partitions=2, job_id="b"))
    other.parts[1].init(0, "t0", FP, torch.ones(other.parts[1].slice_length()))
    other.parts[1].final_checkpoint()
    (tmp_path / "partition-1").rename(tmp_path / "old")
    (tmp_path / "b" / "partition-1").rename(tmp_path / "partition-1")  # partition 1's files now of job b

    restored = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert restored.restore() == 0
    assert restored.parts[0].job.job_id == "a" and restored.parts[1].job is None
    assert restored.snapshot().counters["partitions_restored_empty"] == 1


def test_receive_buffers_of_two_lengths_are_both_reused():
    async def go():
        pool = ReceiveBuffers(min_buffers=4)
        seen = {}
        for round_ in range(3):
            for length in (P, P + 256):
                async with pool.take(length) as held:
                    seen.setdefault(length, set()).add(held.buffer.data_ptr())
        return seen

    seen = asyncio.run(go())
    assert all(len(ptrs) == 1 for ptrs in seen.values())  # one buffer per length, reused every round
