"""Bad input over real gRPC on loopback: a precise status, a message naming the values, state unchanged."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.job import OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.serving.service import ServiceLimits
from tests.conftest import P, make_spec
from tests.helpers import refused


@pytest.fixture
def ready(shard_server):
    """A sync shard with one trainer, initialised, after one applied round (so optimizer state exists)."""
    shard = shard_server()
    shard.register()
    shard.init(torch.randn(P, generator=torch.Generator().manual_seed(1)))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED
    return shard


CASES = {
    "wrong length": (lambda s: s.push(torch.ones(P - 1)), grpc.StatusCode.INVALID_ARGUMENT,
                     ["length is 999 elements but this shard's slice has 1000"]),
    "wrong dtype": (lambda s: s.push(torch.ones(P), dtype=pb.FLOAT16), grpc.StatusCode.INVALID_ARGUMENT,
                    ["dtype is float16 but this job sends float32"]),
    "wrong fingerprint": (lambda s: s.push(torch.ones(P), fingerprint="0" * 16), grpc.StatusCode.FAILED_PRECONDITION,
                          ["fingerprint is '0000000000000000' but the job's is 'ffffffffffffffff'"]),
    "nan": (lambda s: s.push(torch.full((P,), float("nan"))), grpc.StatusCode.INVALID_ARGUMENT,
            ["1000 values are NaN or infinite"]),
    "inf": (lambda s: s.push(torch.ones(P).index_fill_(0, torch.tensor([5]), float("inf"))),
            grpc.StatusCode.INVALID_ARGUMENT, ["1 values are NaN or infinite (first at element 5"]),
    "future version": (lambda s: s.push(torch.ones(P), version=7), grpc.StatusCode.OUT_OF_RANGE,
                       ["base version is 7 but shard 0 is at version 1"]),
    "stale version": (lambda s: s.push(torch.ones(P), version=0), grpc.StatusCode.ABORTED,
                      ["stale gradient: base version 0 is 1 behind version 1"]),
    "unregistered rank": (lambda s: s.push(torch.ones(P), rank=3, version=1), grpc.StatusCode.NOT_FOUND,
                          ["rank 3 is not registered with shard 0"]),
    "superseded trainer process": (lambda s: s.push(torch.ones(P), version=1, trainer_id="t0-old-process"),
                                   grpc.StatusCode.ALREADY_EXISTS,
                                   ["rank 0 is registered as 't0', not 't0-old-process': a newer trainer"]),
    "zero samples": (lambda s: s.push(torch.ones(P), version=1, num_samples=0), grpc.StatusCode.INVALID_ARGUMENT,
                     ["num_samples is 0"]),
    "chunk gap": (lambda s: s.push_chunks([c for i, c in enumerate(_chunks(s)) if i != 1]),
                  grpc.StatusCode.INVALID_ARGUMENT, ["chunk offset is 512 but 256 was expected"]),
    "no header": (lambda s: s.push_chunks(_chunks(s)[1:]), grpc.StatusCode.INVALID_ARGUMENT,
                  ["the first chunk has no header"]),
}


def _chunks(s):
    from psserver.protocol.codec import encode, wire_tensor

    return list(encode(wire_tensor(torch.ones(P), pb.FLOAT32), s.header(version=1), 1024))


@pytest.mark.parametrize("name", list(CASES))
def test_refused_push_leaves_state_bit_identical(ready, name):
    call, code, fragments = CASES[name]
    before = ready.digest()
    refused(lambda: call(ready), code, *fragments)
    assert ready.digest() == before
    # the shard still works: a good push is applied
    assert ready.push(torch.ones(P), version=1).outcome == pb.APPLIED
    assert ready.digest() != before


def test_oversized_message_and_stream_get_resource_exhausted(shard_server):
    small_streams = shard_server(max_push_bytes=2000)
    small_streams.register()
    before = small_streams.digest()
    refused(lambda: small_streams.init(torch.zeros(P)), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "declares 4000 bytes, over this shard's limit of 2000 bytes")
    assert small_streams.digest() == before
    assert small_streams.stats().counters["refused_RESOURCE_EXHAUSTED"] == 1

    small_messages = shard_server(shard=0, max_message_bytes=2048, chunk_bytes=512)
    small_messages.register()
    small_messages.init(torch.zeros(P))
    before = small_messages.digest()
    refused(lambda: small_messages.push(torch.ones(P), chunk_bytes=4000), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert small_messages.digest() == before


def test_register_refuses_a_different_job_naming_the_difference(shard_server):
    shard = shard_server()
    shard.register(rank=0, spec=make_spec(num_trainers=2))
    other = dataclasses.replace(make_spec(num_trainers=2), optimizer=OptimizerConfig("adam", lr=0.5))
    refused(lambda: shard.register(rank=1, spec=other), grpc.StatusCode.FAILED_PRECONDITION,
            "optimizer.name is 'adam' but the job has 'sgd'")
    model = dataclasses.replace(make_spec(num_trainers=2), tensors=(("w", (10, 100), "float32"),), fingerprint="x" * 16)
    refused(lambda: shard.register(rank=1, spec=model), grpc.StatusCode.FAILED_PRECONDITION,
            "parameter #0 is 'w' [10, 100] float32 but the job has 'w' [1000] float32")
    assert list(shard.stats().live_ranks) == [0]


def test_register_catches_shards_listed_in_the_wrong_order(shard_server):
    shard = shard_server(shard=1)
    refused(lambda: shard.register(spec=make_spec(num_shards=2), expected_shard=0), grpc.StatusCode.FAILED_PRECONDITION,
            "this is shard 1 but the trainer listed it as shard 0")


def test_register_refuses_a_malformed_job_spec(shard_server):
    shard = shard_server()
    bad = make_spec().to_proto()
    bad.mode = "bulk"
    refused(lambda: shard.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=bad), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, "job spec: The mode ('bulk')")
    assert shard.stats().mode == ""


def test_pull_before_init_times_out_with_the_reason(shard_server):
    """The shard's own wait (0.2 s) ends long before the caller's deadline (30 s), so the reply that comes
    back is the shard's reason, not gRPC's bare "Deadline Exceeded" -- however loaded the machine."""
    shard = shard_server(limits=ServiceLimits(min_chunk_bytes=256, max_pull_wait=0.2))
    shard.register()
    refused(lambda: shard.pull(timeout=30), grpc.StatusCode.DEADLINE_EXCEEDED,
            "shard 0 was not initialised within 0.2 s: is rank 0 running?")


def test_second_init_changes_nothing(ready):
    before = ready.digest()
    reply = ready.init(torch.zeros(P))
    assert not reply.accepted and ready.digest() == before


def test_duplicate_push_is_acknowledged_not_applied(shard_server):
    shard = shard_server()
    shard.register(spec=make_spec(num_trainers=1, mode="async"))
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED
    after_first = shard.digest()
    reply = shard.push(torch.ones(P))  # a retry of the same (rank, base version)
    assert reply.outcome == pb.DUPLICATE and reply.version == 1
    assert shard.digest() == after_first
    assert shard.stats().counters["duplicates"] == 1


def test_retried_push_after_its_round_closed_is_a_duplicate_not_stale(shard_server):
    """A reply lost after the push closed a round: the retry (same sequence) is acknowledged, not re-applied."""
    shard = shard_server()
    shard.register()
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P), sequence=1).outcome == pb.APPLIED  # closes round 0: version 1
    after = shard.digest()
    retry = shard.push(torch.ones(P), sequence=1)  # same base version 0, now behind
    assert retry.outcome == pb.DUPLICATE and retry.version == 1
    assert shard.digest() == after
    # without the sequence the same bytes are a stale gradient
    refused(lambda: shard.push(torch.ones(P)), grpc.StatusCode.ABORTED, "stale gradient")


def test_nonfinite_skip_policy_counts_and_does_not_apply(shard_server):
    sync = shard_server(nonfinite="skip")
    sync.register()
    sync.init(torch.ones(P))
    bad = torch.ones(P)
    bad[3] = float("nan")
    reply = sync.push(bad)
    assert reply.outcome == pb.SKIPPED and reply.version == 1  # the round closed without a step
    version, params = sync.pull(min_version=1)
    assert version == 1 and torch.equal(params, torch.ones(P))
    counters = sync.stats().counters
    assert counters["nonfinite_skipped"] == 1 and counters["rounds_without_step"] == 1

    asynchronous = shard_server(nonfinite="skip")
    asynchronous.register(spec=make_spec(mode="async"))
    asynchronous.init(torch.ones(P))
    before = asynchronous.digest()
    reply = asynchronous.push(torch.full((P,), float("inf")))
    assert reply.outcome == pb.SKIPPED and reply.version == 0
    assert asynchronous.digest() == before
