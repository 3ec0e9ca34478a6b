"""Pull snapshots are recycled, never while a pull still streams them (Shard only, no network)."""

import torch

from psserver.partition.shard import Shard
from psserver.protocol.proto import ps_pb2 as pb
from psserver.state.snapshots import MAX_SPARE_BUFFERS
from tests.conftest import P, make_spec

FP = "f" * 16


def async_shard() -> Shard:
    shard = Shard(0)
    shard.register(0, "t0", 0, make_spec(mode="async"))
    shard.init(0, "t0", FP, torch.arange(P, dtype=torch.float32))
    return shard


def pull(shard: Shard, wire=pb.FLOAT32):
    return shard.pulls.acquire_snapshot(0, "t0", FP, wire)


def step(shard: Shard, sequence: int) -> None:
    assert shard.push(0, "t0", FP, shard.version, 1, torch.ones(P), sequence)[0].outcome == "applied"


def test_a_pull_streams_the_live_parameters_and_a_step_moves_them_aside_only_while_streamed():
    shard = async_shard()
    v0, held = pull(shard)  # a slow pull keeps streaming version 0
    expected = held.clone()
    assert held.data_ptr() == shard.params.data_ptr()  # no copy for the pull
    step(shard, 1)  # copy on write: the parameters move to another buffer before the step
    assert torch.equal(held, expected) and shard.params.data_ptr() != held.data_ptr()
    assert shard.counters["params_moved_for_pulls"] == 1
    v1, second = pull(shard)
    assert (v0, v1) == (0, 1) and torch.equal(second, shard.params.detach())
    shard.pulls.release_snapshot(second)
    for k in range(2, 8):  # versions whose pulls end before the next step: steps in place, no copies
        step(shard, k)
        shard.pulls.release_snapshot(pull(shard)[1])
    assert shard.counters["params_moved_for_pulls"] == 1
    assert torch.equal(held, expected)  # the first pull's memory was never reused while it streamed
    shard.pulls.release_snapshot(held)
    live = shard.params.data_ptr()
    _, streamed = pull(shard)
    before = streamed.clone()
    step(shard, 8)  # moves again, into recycled memory (the first pull's, now released)
    assert streamed.data_ptr() == live and shard.params.data_ptr() != live and torch.equal(streamed, before)
    assert shard.params.data_ptr() == held.data_ptr()
    assert len(shard.snapshots.buffers) <= MAX_SPARE_BUFFERS


def test_pulls_of_one_version_share_its_snapshot_and_reduced_precision_has_its_own():
    shard = async_shard()
    _, a = pull(shard)
    _, b = pull(shard)
    assert a.data_ptr() == b.data_ptr() == shard.params.data_ptr()
    _, half = pull(shard, pb.BFLOAT16)
    _, half_again = pull(shard, pb.BFLOAT16)
    assert half is half_again  # converted once per version
    assert half.dtype == torch.bfloat16 and torch.equal(half, shard.params.detach().bfloat16())
    step(shard, 1)  # both fp32 pulls still stream: the parameters move; the bf16 copy is a copy anyway
    assert torch.equal(half, torch.arange(P, dtype=torch.float32).bfloat16())
