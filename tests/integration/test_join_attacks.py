"""Elastic joins against a shard in a live re-shard, and joins naming a rank already taken or held, over gRPC:
each refusal's one status, its message naming the field and both values, the state digest unchanged (pending
joins are in it), and the shard still serving (docs/design/attacks-2026-11-24.md)."""

import grpc

from psserver.protocol.errors import REASON_METADATA_KEY
from psserver.protocol.proto import ps_pb2 as pb
from tests.helpers import refused
from tests.integration.test_handoff_io import Job, Op, _Shard, spec, still_serves

ELASTIC = spec(max_trainers=3)


def join(job, i, rank=0, trainer_id="joiner", join_round=0):
    return job.shards[i].stub.Register(pb.RegisterRequest(rank=rank, trainer_id=trainer_id, expected_shard=i,
                                                          join=True, join_round=join_round,
                                                          job=job.job.to_proto()), timeout=10)


def test_a_join_asked_during_a_hand_off_is_unavailable_handoff_and_is_admitted_once_the_plan_aborts(shard_server):
    """Before: a join was admitted between PREPARE and DECIDE, its epoch mixed into moves copied without it."""
    job = Job(shard_server, ELASTIC)
    job.reshard(0, Op.PREPARE)
    error = refused(lambda: join(job, 0), grpc.StatusCode.UNAVAILABLE, "join is set",
                    "re-sharding under plan 'p1'", unchanged=_Shard(job, 0))
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "handoff"
    assert job.shards[0].stats(fingerprint=ELASTIC.fingerprint).counters["refused_UNAVAILABLE"] == 1
    job.reshard(0, Op.DECIDE, switch=False)
    assert join(job, 0).join_round > 0  # the plan aborted: the same join is admitted
    still_serves(job)


def test_a_join_naming_a_rank_a_member_or_another_joiner_holds_is_resource_exhausted_naming_both(shard_server):
    job = Job(shard_server, ELASTIC)
    assert join(job, 1, rank=1, trainer_id="first").join_round > 0
    refused(lambda: join(job, 1, rank=1, trainer_id="second"), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rank 1 is being joined by 'first', not 'second'", unchanged=_Shard(job, 1))
    refused(lambda: join(job, 1, rank=0, trainer_id="second"), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rank 0 is already a member of the job", "'second' cannot join as it", unchanged=_Shard(job, 1))
    still_serves(job, 1)
