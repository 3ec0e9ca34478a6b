"""An attacker's pass over elastic jobs with sparse tables, over real gRPC (docs/security.md): table pushes from a
rank outside its round's epoch, a sync push one round ahead (the prefetch race), and GetStats' timeline asked by a
stranger or from the far future.  Each refusal: one status, a message naming the field and both values, the shard's
state digest unchanged, and the shard still serving."""

import concurrent.futures

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until
from tests.integration.test_step_rpc import rows as step_rows, step
from tests.integration.test_sparse_rpc import DIM, FP, pull_rows, push_rows, rows_chunks, table


def elastic(mode="sync", num_trainers=1):
    return make_spec(mode=mode, num_trainers=num_trainers, max_trainers=num_trainers + 1, tables=(table(),))


def join(shard, spec, join_round=0, rank=0, trainer_id="t1"):
    return shard.stub.Register(pb.RegisterRequest(rank=rank, trainer_id=trainer_id, job=spec.to_proto(), join=True,
                                                  join_round=join_round), timeout=10)


def started(shard_server, spec):
    shard = shard_server()
    for rank in range(spec.num_trainers):
        shard.register(rank=rank, spec=spec)
    shard.init(torch.zeros(P))
    return shard


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_table_push_from_a_joiner_that_has_not_committed_is_failed_precondition_and_enters_no_round(
        shard_server, mode):
    """Admitted but never committed, a joiner is in no epoch: its rows must not be summed into a table round (they
    were, from anyone who asked to join -- the dense push was already refused so)."""
    spec = elastic(mode)
    shard = started(shard_server, spec)
    assert join(shard, spec).rank == 1
    refused(lambda: push_rows(shard, rows_chunks([1, 2], torch.full((2, DIM), 1000.0), rank=1)),
            grpc.StatusCode.FAILED_PRECONDITION, "rank 1 is in no membership epoch", "base version is 0",
            unchanged=shard)
    assert push_rows(shard, rows_chunks([1, 2])).outcome == pb.APPLIED  # still serving: rank 0's round closes
    version, rows = pull_rows(shard, [1, 2], min_version=1)
    assert version == 1 and rows.abs().max() < 100


def test_a_sync_table_push_before_the_joiners_round_is_failed_precondition_naming_both_rounds(shard_server):
    spec = elastic()
    shard = started(shard_server, spec)
    proposal = join(shard, spec).join_round
    assert join(shard, spec, join_round=proposal, rank=1).membership_epoch == 1
    refused(lambda: push_rows(shard, rows_chunks([1], rank=1)), grpc.StatusCode.FAILED_PRECONDITION,
            f"base version is 0 but rank 1 is a member of this job from round {proposal}", unchanged=shard)
    assert push_rows(shard, rows_chunks([1])).outcome == pb.APPLIED


def test_a_sync_table_push_after_an_announced_leave_is_failed_precondition(shard_server):
    """A leave announced on the dense push (ChunkHeader.leaving) takes the rank out from the next round: a table
    push into that round, before its Leave, is no round's."""
    spec = make_spec(num_trainers=2, max_trainers=2, tables=(table(),))
    shard = started(shard_server, spec)
    shard.push(torch.ones(P))
    hdr = shard.header(rank=1)
    hdr.leaving = True  # rank 1's last dense gradient
    assert shard.stub.Push(encode(wire_tensor(torch.ones(P), pb.FLOAT32), hdr, 1024), timeout=10).outcome == \
        pb.APPLIED
    assert push_rows(shard, rows_chunks([1], rank=1)).outcome == pb.ACCEPTED  # its last step's rows: round 0
    assert push_rows(shard, rows_chunks([1])).outcome == pb.APPLIED
    refused(lambda: push_rows(shard, rows_chunks([1], rank=1, seq=2, base=1)), grpc.StatusCode.FAILED_PRECONDITION,
            "base version is 1", "rank 1", unchanged=shard)
    assert push_rows(shard, rows_chunks([1], seq=2, base=1)).outcome == pb.APPLIED  # round 1 expects rank 0 only


def test_a_sync_table_push_one_round_ahead_from_a_rank_in_the_open_round_waits_for_its_close(shard_server):
    """The prefetch race: a trainer that pulled no rows of this shard for its next step pushes (empty) on base
    v + 1 while round v still waits for another trainer.  It was refused as from the future -- OUT_OF_RANGE, the
    trainer's restart signal; it now waits for round v to close, as a pull of v + 1 does."""
    spec = make_spec(num_trainers=2, tables=(table(),))
    shard = started(shard_server, spec)
    assert push_rows(shard, rows_chunks([1])).outcome == pb.ACCEPTED  # rank 0 is in round 0
    early = shard.stub.PushRows.future(iter(rows_chunks([], seq=2, base=1)), timeout=30)
    wait_until(lambda: shard.stats().counters.get("row_pushes_waited", 0) >= 1, what="the early push to wait")
    assert not early.done()
    assert push_rows(shard, rows_chunks([2], rank=1)).outcome == pb.APPLIED  # round 0 closes
    reply = early.result()
    assert (reply.outcome, reply.version) == (pb.ACCEPTED, 1)  # rank 0's push of round 1
    assert push_rows(shard, rows_chunks([2], rank=1, seq=2, base=1)).outcome == pb.APPLIED
    assert pull_rows(shard, [1])[0] == 2


def test_a_table_push_ahead_from_a_rank_not_in_the_open_round_is_still_out_of_range_at_once(shard_server):
    """Only a rank the open round holds may wait, and only one round: anything else ahead means the shard
    restarted from an older checkpoint (a stranger cannot park pushes)."""
    spec = make_spec(num_trainers=2, tables=(table(),))
    shard = started(shard_server, spec)
    assert push_rows(shard, rows_chunks([1])).outcome == pb.ACCEPTED
    refused(lambda: push_rows(shard, rows_chunks([1], rank=1, base=1)), grpc.StatusCode.OUT_OF_RANGE,
            "base version is 1 but table 'emb' is at version 0", unchanged=shard)
    refused(lambda: push_rows(shard, rows_chunks([1], seq=2, base=2)), grpc.StatusCode.OUT_OF_RANGE,
            "base version is 2 but table 'emb' is at version 0", unchanged=shard)
    assert shard.stats().counters.get("row_pushes_waited", 0) == 0
    assert push_rows(shard, rows_chunks([2], rank=1)).outcome == pb.APPLIED


def test_get_stats_from_a_stranger_past_every_epoch_lists_the_last_epoch_and_withholds_the_job(shard_server):
    spec = elastic()
    shard = started(shard_server, spec)
    join(shard, spec, join_round=join(shard, spec).join_round, rank=1)
    reply = shard.stub.GetStats(pb.StatsRequest(members_from_round=2 ** 64 - 1, rank=7, trainer_id="x"), timeout=10)
    assert [(e.round, e.size, list(e.members)) for e in reply.epochs] == [(0, 1, []), (2, 2, [0, 1])]
    assert not reply.HasField("job")
    assert push_rows(shard, rows_chunks([1])).outcome == pb.APPLIED


def test_a_step_calls_table_part_one_round_ahead_waits_for_the_open_rounds_close(shard_server):
    """The same race through the Step RPC: its table part was checked (and refused as from the future) before
    any part is applied; it now waits there first, holding nothing of the rank's."""
    spec = make_spec(num_trainers=2, tables=(table(),))
    shard = started(shard_server, spec)
    assert push_rows(shard, rows_chunks([1])).outcome == pb.ACCEPTED
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        early = pool.submit(step, shard, step_rows(0, rows_chunks([], seq=2, base=1)))
        wait_until(lambda: shard.stats().counters.get("row_pushes_waited", 0) >= 1, what="the Step to wait")
        assert not early.done()
        assert push_rows(shard, rows_chunks([2], rank=1)).outcome == pb.APPLIED
        reply = early.result()[0][0].header.push
    assert (reply.outcome, reply.version) == (pb.ACCEPTED, 1)
    assert push_rows(shard, rows_chunks([2], rank=1, seq=2, base=1)).outcome == pb.APPLIED


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_row_pull_from_a_joiner_that_has_not_committed_is_failed_precondition_and_creates_no_row(
        shard_server, mode):
    """Admitted but never committed, a joiner is in no epoch: its PullRows created the rows it named (lazily), so
    anyone who asked to join could grow the tables without ever joining (docs/design/elastic-join.md)."""
    spec = elastic(mode)
    shard = started(shard_server, spec)
    assert join(shard, spec).rank == 1
    created = shard.stats().counters.get("table.emb.rows_created", 0)
    refused(lambda: pull_rows(shard, [11, 12, 13], rank=1), grpc.StatusCode.FAILED_PRECONDITION,
            "rank 1 is in no membership epoch", "min_version is 0", unchanged=shard)
    assert shard.stats().counters.get("table.emb.rows_created", 0) == created
    assert push_rows(shard, rows_chunks([1, 2])).outcome == pb.APPLIED  # still serving
    assert pull_rows(shard, [11], min_version=1)[0] == 1
    proposal = join(shard, spec).join_round  # once committed, it pulls as any member
    join(shard, spec, join_round=proposal, rank=1)
    assert pull_rows(shard, [11, 12], rank=1)[1].shape == (2, DIM)


def test_a_plain_register_of_a_rank_that_left_answers_the_round_it_is_a_member_from_which_its_table_lanes_take(
        shard_server):
    """A rank that left and registers again without --join is a member from the round open at its Register; a
    sync table may be a round behind then (the others' table pushes in flight).  Its lanes must start at that
    round (trainer.membership.session.track_rows reads ``join_round``), not at the table's version: round 1 is not its."""
    spec = make_spec(num_trainers=2, max_trainers=2, tables=(table(),))
    shard = started(shard_server, spec)
    for rank in (0, 1):
        shard.push(torch.ones(P), rank=rank)
        push_rows(shard, rows_chunks([1], rank=rank))
    shard.stub.Leave(pb.LeaveRequest(rank=1, trainer_id="t1", fingerprint=FP), timeout=10)  # out from round 1
    assert shard.push(torch.ones(P), version=1).outcome == pb.APPLIED  # rank 0's dense round 1: version 2
    assert shard.register(rank=0, spec=spec).join_round == 0  # a member all along: no round to start from
    reply = shard.register(rank=1, spec=spec)  # rank 0's table push of round 1 is still in flight: table at 1
    assert (reply.version, reply.join_round) == (2, 2)
    refused(lambda: push_rows(shard, rows_chunks([1], rank=1, seq=2, base=1)), grpc.StatusCode.FAILED_PRECONDITION,
            "base version is 1 but rank 1 is a member of this job from round 2", unchanged=shard)
    assert push_rows(shard, rows_chunks([1], seq=2, base=1)).outcome == pb.APPLIED  # table round 1: rank 0 only
    assert push_rows(shard, rows_chunks([1], rank=1, seq=2, base=2)).outcome == pb.ACCEPTED  # round 2 is its first
