"""PushPull: a push and the pull after it in one call -- the same checks, outcomes and state as the two."""

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused


def started(shard_server, mode="sync", **spec):
    shard = shard_server()
    shard.register(spec=make_spec(mode=mode, **spec))
    shard.init(torch.arange(P, dtype=torch.float32))
    return shard


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_reply_carries_the_weights_after_the_step(shard_server, mode):
    shard = started(shard_server, mode)
    header, weights = shard.push_pull(torch.ones(P), sequence=1)
    assert header.outcome == pb.APPLIED and header.version == 1 and header.length == P
    assert torch.equal(weights, shard.pull(min_version=1)[1])
    assert not torch.equal(weights, torch.arange(P, dtype=torch.float32))


def test_in_sync_mode_the_reply_waits_for_the_round_to_close(shard_server):
    shard = started(shard_server, num_trainers=2)
    shard.register(rank=1, spec=make_spec(num_trainers=2))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(shard.push_pull, torch.ones(P), sequence=1)
        second_header, second = shard.push_pull(torch.full((P,), 3.0), rank=1, sequence=1)
        first_header, first_weights = first.result(timeout=10)
    assert {first_header.outcome, second_header.outcome} == {pb.ACCEPTED, pb.APPLIED}
    assert first_header.version == second_header.version == 1  # both got the closed round's weights
    assert torch.equal(first_weights, second)


def test_a_stale_gradient_is_dropped_and_the_reply_is_the_current_weights(shard_server):
    shard = started(shard_server, "async", max_staleness=0)
    shard.push_pull(torch.ones(P), sequence=1)  # version 1
    before = shard.digest()
    header, weights = shard.push_pull(torch.ones(P), version=0, sequence=2)  # based on version 0: stale
    assert header.outcome == pb.STALE and header.staleness == 1 and header.version == 1
    assert shard.digest() == before
    assert torch.equal(weights, shard.pull(min_version=1)[1])
    assert shard.stats().counters["stale_dropped"] == 1


def test_a_retry_is_a_duplicate_and_still_gets_the_weights(shard_server):
    shard = started(shard_server)
    header, weights = shard.push_pull(torch.ones(P), sequence=1)
    after = shard.digest()
    retry_header, retry_weights = shard.push_pull(torch.ones(P), sequence=1)  # the reply was "lost"
    assert retry_header.outcome == pb.DUPLICATE and retry_header.version == 1
    assert torch.equal(retry_weights, weights) and shard.digest() == after


@pytest.mark.parametrize("change,code,fragment", [
    (dict(grad=torch.full((P,), float("nan"))), grpc.StatusCode.INVALID_ARGUMENT, "values are NaN or infinite"),
    (dict(grad=torch.ones(P - 1)), grpc.StatusCode.INVALID_ARGUMENT, "but this shard's slice has 1000"),
    (dict(version=9), grpc.StatusCode.OUT_OF_RANGE, "base version is 9"),
    (dict(rank=5), grpc.StatusCode.NOT_FOUND, "rank 5 is not registered"),
    (dict(fingerprint="0" * 16), grpc.StatusCode.FAILED_PRECONDITION, "fingerprint is"),
])
def test_refusals_are_those_of_push_and_change_nothing(shard_server, change, code, fragment):
    shard = started(shard_server)
    before = shard.digest()
    grad = change.pop("grad", torch.ones(P))
    refused(lambda: shard.push_pull(grad, sequence=1, **change), code, fragment)
    assert shard.digest() == before
