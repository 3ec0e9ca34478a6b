"""Pull snapshots are recycled, never while a pull still streams them (Shard only, no network)."""

import gc

import torch

from psserver.proto import ps_pb2 as pb
from psserver.service import _SnapshotStream
from psserver.shard import MAX_SNAPSHOT_BUFFERS, Shard
from tests.conftest import P, make_spec

FP = "f" * 16


def async_shard() -> Shard:
    shard = Shard(0)
    shard.register(0, "t0", 0, make_spec(mode="async"))
    shard.init(0, "t0", FP, torch.arange(P, dtype=torch.float32))
    return shard


def pull(shard: Shard, wire=pb.FLOAT32):
    version, snapshot, _ = shard.pull(0, "t0", FP, 0, wire, timeout=1)
    return version, snapshot


def step(shard: Shard, sequence: int) -> None:
    assert shard.push(0, "t0", FP, shard.version, 1, torch.ones(P), sequence).outcome == "applied"


def test_a_snapshot_being_streamed_is_never_overwritten_and_released_ones_are_reused():
    shard = async_shard()
    v0, held = pull(shard)  # a slow pull keeps streaming this one
    expected = held.clone()
    step(shard, 1)
    v1, second = pull(shard)
    assert (v0, v1) == (0, 1)
    assert second.data_ptr() != held.data_ptr()
    shard.release_snapshot(second)
    step(shard, 2)
    v2, third = pull(shard)
    assert third.data_ptr() == second.data_ptr()  # recycled: no fresh slice-sized allocation
    assert torch.equal(third, shard.params.detach())
    for k in range(3, 8):  # many versions while the first pull still streams
        step(shard, k)
        shard.release_snapshot(pull(shard)[1])
    assert torch.equal(held, expected)
    assert len(shard._snapshot_buffers) <= MAX_SNAPSHOT_BUFFERS


def test_pulls_of_one_version_share_its_snapshot_and_reduced_precision_has_its_own():
    shard = async_shard()
    _, a = pull(shard)
    _, b = pull(shard)
    assert a is b
    _, half = pull(shard, pb.BFLOAT16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, shard.params.detach().bfloat16())


def test_a_stream_releases_its_snapshot_once_when_done_or_dropped_unstarted():
    released = []
    finished = _SnapshotStream(iter([1, 2]), lambda: released.append("finished"))
    assert list(finished) == [1, 2]
    finished.close()
    dropped = _SnapshotStream(iter([1, 2]), lambda: released.append("dropped"))
    del dropped
    gc.collect()
    assert released == ["finished", "dropped"]
