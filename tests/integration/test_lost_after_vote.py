"""A drained shard lost between its vote and DECIDE (docs/design/handoff-io.md, "A drained shard lost after its vote"):
real shards over gRPC on loopback, the test as the coordinator and as a sync trainer of rank 0 (the rounds of
tests/integration/test_handoff_drain.Run).  The drained shard is stopped after every source voted at R; the
remaining shards switch; the trainer, its held round R-1 reply lost with the shard, asks the new owners of the
lost slot's range, who answer from the slot's push book at R that moved with the vote -- never from the other
shards' replies.  Each refusal: one status, a message naming the field and both values, the digest unchanged, the
shard still serving."""

import grpc
import pytest
import torch

from psserver.protocol.layout import shard_range
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_handoff_drain import Op, Run
from tests.integration.test_handoff_io import pull


def ask(run: Run, new_slot: int, old_slot: int, base: int, sequence: int, pushpull=False, rank=0, trainer_id="t0",
        length=0):
    """Rank 0's question to layout 1's slot ``new_slot`` for old slot ``old_slot`` (no gradient: length 0)."""
    shard = run.shards[run.on[new_slot]]
    h = shard.header(n=length, version=base, sequence=sequence, fingerprint=run.job.fingerprint)
    h.layout_epoch, h.moved_from, h.rank, h.trainer_id = run.epoch, old_slot + 1, rank, trainer_id
    if pushpull:
        chunks = list(shard.stub.PushPull(iter([pb.Chunk(header=h)]), timeout=10))
        return chunks[0].header, torch.frombuffer(bytearray(b"".join(c.data for c in chunks)), dtype=torch.float32)
    return shard.stub.Push(iter([pb.Chunk(header=h)]), timeout=10)


@pytest.fixture
def lost(shard_server):
    """3 -> 2 with shard 2 drained and stopped after every source voted at R; shards 0 and 1 switched.  Returns
    (run, R, shard 2's round R-1 sequence, the reference on two shards that never re-sharded)."""
    shards = [shard_server(shard=i % 3, lease_timeout=0) for i in range(5)]  # 0-2: the job; 3-4: the reference
    run, ref = Run(shards, [0, 1, 2]), Run(shards, [3, 4])
    run.rounds(2)
    R = run.prepare_and_commit("drain", [0, 1])
    shards[2].server.stop(grace=0)  # lost after its vote: its held reply of round R-1 goes with it
    for i in (0, 1):
        assert run.call(i, Op.DECIDE, "drain", [0, 1], switch=True).layout_epoch == 1
    assert [f.result().layout_epoch for f in run.held[:2]] == [1, 1]
    with pytest.raises(grpc.RpcError):
        run.held[2].result()
    sequence = run.seq[(2, 0)]
    run.held = []
    run.follow("drain", [0, 1])
    ref.rounds(R)
    return run, R, sequence, ref


def test_the_new_owners_of_a_lost_drained_slot_answer_its_round_r_minus_1_push_duplicate_with_the_weights_at_r(
        lost):
    run, R, sequence, ref = lost
    old = shard_range(P, 3, 2)
    owners = [j for j, (a, b) in enumerate(run.ranges()) if a < old[1] and old[0] < b]
    assert owners == [1]  # old slot 2 lies wholly in new slot 1 (3 -> 2)
    digest = run.shards[1].digest(fingerprint=run.job.fingerprint)
    reply = ask(run, 1, 2, R - 1, sequence)
    assert (reply.outcome, reply.version, reply.layout_epoch) == (pb.DUPLICATE, R, 1)
    header, weights = ask(run, 1, 2, R - 1, sequence, pushpull=True)
    assert (header.outcome, header.version) == (pb.DUPLICATE, R)
    at_r = torch.cat([pull(run.shards[0], 1, R, run.job.fingerprint)[1], weights])
    assert torch.equal(at_r, ref.weights(R))  # the parameters at R equal the job that never re-sharded
    counters = run.shards[1].stats(fingerprint=run.job.fingerprint).counters
    assert counters["moved_pushes_duplicate"] == 2
    assert run.shards[1].digest(fingerprint=run.job.fingerprint) == digest  # nothing applied
    for j in (0, 1):  # nothing was applied: round R closes in layout 1 with the next pushes, as usual
        assert run.push(j, R).outcome == pb.APPLIED
    assert [run.version(j) for j in (0, 1)] == [R + 1] * 2


def test_a_push_the_lost_slots_round_closed_without_is_answered_stale_and_changes_nothing(lost):
    run, R, sequence, _ = lost
    digest = run.shards[1].digest(fingerprint=run.job.fingerprint)
    error = refused(lambda: ask(run, 1, 2, R - 1, sequence + 1), grpc.StatusCode.ABORTED, "stale gradient",
                    f"round {R - 1} closed without rank 0's push numbered {sequence + 1}", f"R={R}")
    assert dict(error.trailing_metadata())["ps-version"] == str(R)
    header, _ = ask(run, 1, 2, R - 1, sequence + 1, pushpull=True)  # PushPull: the stale outcome, weights at R
    assert (header.outcome, header.version) == (pb.STALE, R)
    assert run.shards[1].digest(fingerprint=run.job.fingerprint) == digest
    assert run.shards[1].stats(fingerprint=run.job.fingerprint).counters["moved_pushes_stale"] == 2
    assert run.push(1, R).outcome in (pb.ACCEPTED, pb.APPLIED)  # still serves


@pytest.mark.parametrize("new_slot, old_slot, base_less, fragments", [
    (0, 2, 1, ("moved_from is 3 (old slot 2)", "old slots [0, 1]")),  # new slot 0 drew nothing from old slot 2
    (1, 2, 2, ("base version is {b}", "round {r1} (R-1) only")),
], ids=["a-slot-it-holds-no-book-of", "another-base"])
def test_a_question_this_piece_holds_no_book_for_is_failed_precondition_naming_the_field(lost, new_slot, old_slot,
                                                                                          base_less, fragments):
    run, R, sequence, _ = lost
    base = R - base_less
    shard = run.shards[run.on[new_slot]]
    digest = shard.digest(fingerprint=run.job.fingerprint)
    refused(lambda: ask(run, new_slot, old_slot, base, sequence), grpc.StatusCode.FAILED_PRECONDITION,
            *(f.format(b=base, r1=R - 1) for f in fragments))
    assert shard.digest(fingerprint=run.job.fingerprint) == digest
    assert run.push(new_slot, R).outcome in (pb.ACCEPTED, pb.APPLIED)  # still serves


def test_a_question_from_another_trainer_process_is_fenced_off_as_its_pushes_are(lost):
    run, R, sequence, _ = lost
    digest = run.shards[1].digest(fingerprint=run.job.fingerprint)
    refused(lambda: ask(run, 1, 2, R - 1, sequence, trainer_id="intruder"), grpc.StatusCode.ALREADY_EXISTS,
            "registered as 't0', not 'intruder'")
    assert run.shards[1].digest(fingerprint=run.job.fingerprint) == digest
    assert ask(run, 1, 2, R - 1, sequence).outcome == pb.DUPLICATE  # still serves the member


def test_a_question_that_carries_a_gradient_is_invalid_argument_and_changes_nothing(lost):
    run, R, sequence, _ = lost
    digest = run.shards[1].digest(fingerprint=run.job.fingerprint)
    refused(lambda: ask(run, 1, 2, R - 1, sequence, length=4), grpc.StatusCode.INVALID_ARGUMENT, "length is 4",
            "carries no gradient: 0")
    assert run.shards[1].digest(fingerprint=run.job.fingerprint) == digest
    assert run.push(1, R).outcome in (pb.ACCEPTED, pb.APPLIED)  # still serves
