"""The data cursor's ClaimBatch, and a claim carried by a PushPull, over real gRPC (psserver.members.data_cursor,
docs/design/elastic-join.md): grants, a retried claim answered the same batch, a leaver's batch re-issued, and each refusal one status with a message naming the
field and both values, the shard's state digest unchanged, and the shard still serving."""

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused

ASYNC = make_spec(mode="async", num_trainers=2, max_trainers=3)


def claim(shard, number, rank=0, per_epoch=4, release=False, fingerprint="f" * 16):
    return shard.stub.ClaimBatch(pb.ClaimRequest(rank=rank, trainer_id=f"t{rank}", fingerprint=fingerprint,
                                                 claim=number, batches_per_epoch=per_epoch, release=release),
                                 timeout=10)


@pytest.fixture
def running(shard_server):
    """An async elastic shard with ranks 0 and 1 registered and initialised."""
    shard = shard_server()
    shard.register(spec=ASYNC)
    shard.register(rank=1, spec=ASYNC)
    shard.init(torch.zeros(P))
    return shard


def still_serves(shard):
    assert claim(shard, 1, rank=1).granted


def test_claims_are_granted_in_turn_and_a_retry_gets_the_same_batch(running):
    assert [claim(running, 1).batch, claim(running, 1, rank=1).batch, claim(running, 2).batch] == [0, 1, 2]
    assert claim(running, 2).batch == 2  # a retry (a lost reply): the same batch, nothing new granted
    assert claim(running, 3).batch == 3


def test_a_rank_that_leaves_without_releasing_has_its_batch_reissued(running):
    claim(running, 1)
    assert claim(running, 1, rank=1).batch == 1
    running.stub.Leave(pb.LeaveRequest(rank=1, trainer_id="t1", fingerprint="f" * 16), timeout=10)
    reply = claim(running, 2)
    assert (reply.batch, reply.reissued) == (1, True)
    assert running.stats().counters["batches_reissued"] == 1


def test_a_claim_number_out_of_turn_is_invalid_argument_naming_both(running):
    claim(running, 1)
    refused(lambda: claim(running, 5), grpc.StatusCode.INVALID_ARGUMENT,
            "claim is 5 but rank 0's next claim is 2", unchanged=running)
    still_serves(running)


def test_batches_per_epoch_unlike_the_jobs_is_failed_precondition_naming_both(running):
    claim(running, 1)
    refused(lambda: claim(running, 1, rank=1, per_epoch=7), grpc.StatusCode.FAILED_PRECONDITION,
            "batches_per_epoch is 7 but the job's is 4", unchanged=running)
    refused(lambda: claim(running, 1, rank=1, per_epoch=0), grpc.StatusCode.INVALID_ARGUMENT,
            "batches_per_epoch is 0 but must be 1..", unchanged=running)
    still_serves(running)


def test_a_claim_in_a_sync_job_is_failed_precondition(shard_server):
    shard = shard_server()
    shard.register(spec=make_spec(max_trainers=2))
    shard.init(torch.zeros(P))
    refused(lambda: claim(shard, 1), grpc.StatusCode.FAILED_PRECONDITION, "mode is sync", unchanged=shard)
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED


def test_a_claim_from_a_stranger_is_refused_and_changes_nothing(running):
    refused(lambda: claim(running, 1, rank=2), grpc.StatusCode.NOT_FOUND, "rank 2 is not registered",
            unchanged=running)
    still_serves(running)


def push_pull_claiming(shard, number, sequence, per_epoch=4):
    """A PushPull from rank 0 whose header also claims (ChunkHeader.claim): the reply's header."""
    h = shard.header(sequence=sequence)
    h.claim, h.batches_per_epoch = number, per_epoch
    return list(shard.stub.PushPull(encode(wire_tensor(torch.ones(P), pb.FLOAT32), h, 1024), timeout=10))[0].header


def test_a_push_pull_carrying_a_claim_is_answered_its_batch_and_a_retry_of_it_the_same(running):
    assert claim(running, 1).batch == 0
    reply = push_pull_claiming(running, 2, sequence=1)
    assert (reply.outcome, reply.batch_granted, reply.batch) == (pb.APPLIED, True, 1)
    again = push_pull_claiming(running, 2, sequence=1)  # the same push sent again after a lost reply
    assert (again.outcome, again.batch_granted, again.batch) == (pb.DUPLICATE, True, 1)
    assert claim(running, 1, rank=1).batch == 2


def test_a_push_carrying_a_claim_out_of_turn_is_applied_without_a_grant_and_counted(running):
    claim(running, 1)
    reply = push_pull_claiming(running, 7, sequence=1)
    assert (reply.outcome, reply.batch_granted) == (pb.APPLIED, False)
    assert running.stats().counters["push_claims_ignored"] == 1
    assert claim(running, 2).batch == 1  # the cursor did not move
