"""Partition ranges: they tile each shard's slice, are aligned and balanced, and never cross shards."""

import pytest

from psserver.protocol.job import JobSpec
from psserver.protocol.layout import PARTITION_ALIGN, partition_range, partitions_for, shard_range


@pytest.mark.parametrize("total", [0, 1, 5, 255, 256, 257, 1000, 2252, 1 << 20, 11_689_512])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
@pytest.mark.parametrize("partitions", [1, 2, 3, 5, 64])
def test_partitions_tile_each_slice_in_aligned_balanced_runs(total, num_shards, partitions):
    for shard in range(num_shards):
        start, end = shard_range(total, num_shards, shard)
        pieces = [partition_range(total, num_shards, partitions, shard, k) for k in range(partitions)]
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # contiguous, in order
        assert all(s <= e for s, e in pieces)
        for s, e in pieces[:-1]:  # every inner edge a whole number of units from the slice's start
            assert (e - start) % PARTITION_ALIGN == 0 or e == end
        full = [e - s for s, e in pieces if e - s]
        if len(full) > 1:  # balanced within one unit (the last may hold a partial one)
            assert max(full) - min(full) <= PARTITION_ALIGN


def test_one_partition_is_the_whole_slice():
    for shard in range(3):
        assert partition_range(1000, 3, 1, shard, 0) == shard_range(1000, 3, shard)


def test_a_slice_smaller_than_its_partitions_leaves_some_empty():
    # 257 elements in 3 partitions: 2 units -> [0,0), [0,256), [256,257)
    assert [partition_range(514, 2, 3, 1, k) for k in range(3)] == [(257, 257), (257, 513), (513, 514)]


@pytest.mark.parametrize("elements,partition_bytes,expected", [
    (1_000_000, 0, 1),  # off
    (1_000_000, 4 << 20, 1),  # 4 MB slice in 4 MB pieces
    (1_000_000, 1 << 20, 4),
    (5_845_000, 4 << 20, 6),  # half of ResNet-18 in ~4 MB pieces
    (300, 4, 2),  # never more than the slice's 256-element units
    (0, 1024, 1),
])
def test_partitions_for_a_slice_never_exceed_its_byte_budget_or_units(elements, partition_bytes, expected):
    assert partitions_for(elements, partition_bytes) == expected


def test_a_partition_index_out_of_range_is_refused_naming_it():
    with pytest.raises(ValueError, match="Partition 3 is out of range for 3 partitions"):
        partition_range(100, 1, 3, 0, 3)


def test_the_job_spec_bounds_partitions_and_carries_them_on_the_wire():
    spec = JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=10, fingerprint="f" * 16, partitions=4)
    assert JobSpec.from_proto(spec.to_proto()).partitions == 4
    assert "partitions is 2 but the job has 4" in spec.difference(
        JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=10, fingerprint="f" * 16, partitions=2))
    with pytest.raises(ValueError, match=r"partitions per shard \(0\) must be between 1 and 256"):
        JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=10, fingerprint="f" * 16, partitions=0)
    older = spec.to_proto()
    older.ClearField("partitions")  # a trainer or checkpoint from before partitions: one
    assert JobSpec.from_proto(older).partitions == 1
