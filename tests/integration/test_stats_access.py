"""Who sees what in GetStats (issue 20, findings 5 and 9).

Anyone may read a shard's counters, version and mode (ps-server stats, ps-cluster's summary); the job's spec --
its id, fingerprint and everything a trainer registers with -- only a member of the job, or any caller of a shard
that authenticates them all (a token or mutual TLS).  Withheld, not refused: the reply simply has no ``job``.
And ``ps-server stats`` reads a reply of any size the shard sends (a big spec once cost "no shard answered").
"""

import dataclasses

import grpc
import pytest
import torch

from psserver.admin import Down, fetch_stats, format_stats
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.security import ClientSecurity, ServerSecurity
from psserver.protocol.stubs import STATS_CHANNEL_OPTIONS, fetch_stat
from tests.conftest import P, make_spec

TOKEN = "stats-token-value"
FP = "f" * 16
JOB_ID = "secret-job-7"
GRPC_DEFAULT_RECEIVE = 4 << 20

STRANGERS = {
    "no identity": {},
    "unregistered rank": dict(rank=3, trainer_id="t3", fingerprint=FP),
    "another trainer id": dict(rank=0, trainer_id="intruder", fingerprint=FP),
    "another fingerprint": dict(rank=0, trainer_id="t0", fingerprint="0" * 16),
    "an over-long trainer id": dict(rank=0, trainer_id="t" * 100_000, fingerprint=FP),
}


def running_job(shard_server, **cfg):
    shard = shard_server(lease_timeout=0, **cfg)
    spec = make_spec(num_trainers=2, job_id=JOB_ID)
    shard.register(rank=0, spec=spec)
    shard.register(rank=1, spec=spec)
    assert shard.init(torch.zeros(P)).accepted
    return shard, spec


@pytest.mark.parametrize("who", list(STRANGERS))
def test_stats_for_a_caller_who_is_not_a_member_carry_counters_version_and_mode_but_not_the_job(shard_server, who):
    shard, _ = running_job(shard_server)
    assert shard.push(torch.ones(P), rank=0).outcome == pb.ACCEPTED
    before = shard.digest()
    reply = shard.stub.GetStats(pb.StatsRequest(**STRANGERS[who]), timeout=10)
    assert not reply.HasField("job")
    assert JOB_ID.encode() not in reply.SerializeToString() and FP.encode() not in reply.SerializeToString()
    assert reply.mode == "sync" and reply.version == 0 and reply.initialized and list(reply.live_ranks) == [0, 1]
    assert reply.counters["pushes_applied"] == 1 and reply.counters["registrations"] == 2
    assert not any(k.startswith("refused_") for k in reply.counters)  # withheld, not refused
    assert shard.digest() == before
    assert shard.push(torch.ones(P), rank=1).outcome == pb.APPLIED  # still serving


def test_a_member_of_the_job_gets_the_job_spec_in_its_stats(shard_server):
    shard, spec = running_job(shard_server)
    for rank in (0, 1):
        reply = shard.stats(rank=rank)  # rank, its trainer id and the job's fingerprint
        assert reply.job.job_id == JOB_ID and reply.job.fingerprint == FP and reply.job.num_trainers == 2


def test_a_trainer_that_left_no_longer_gets_the_job_spec(shard_server):
    shard, _ = running_job(shard_server)
    shard.stub.Leave(pb.LeaveRequest(rank=1, trainer_id="t1", fingerprint=FP), timeout=10)
    assert not shard.stats(rank=1).HasField("job")
    assert shard.stats(rank=0).job.job_id == JOB_ID


def test_every_partition_withholds_the_job_from_strangers_and_shows_it_to_members(shard_server):
    shard = shard_server(lease_timeout=0)
    spec = make_spec(job_id=JOB_ID, partitions=3)
    for k in range(3):
        shard.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=spec.to_proto(), partition=k),
                            timeout=10)
    for k in range(3):
        assert not shard.stub.GetStats(pb.StatsRequest(partition=k), timeout=10).HasField("job")
        assert shard.stats(partition=k).job.job_id == JOB_ID


def test_a_shard_with_a_token_shows_the_job_spec_to_any_caller_holding_the_token(shard_server):
    shard = shard_server(lease_timeout=0, security=ServerSecurity(token=TOKEN))
    with ClientSecurity(token=TOKEN).channel(shard.server.address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=make_spec(job_id=JOB_ID).to_proto()),
                      timeout=10)
        assert stub.GetStats(pb.StatsRequest(), timeout=10).job.job_id == JOB_ID
    with grpc.insecure_channel(shard.server.address) as channel:  # without the token: nothing at all
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.ParameterServerStub(channel).GetStats(pb.StatsRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_trainer_reads_its_own_job_in_the_shards_stats(shard_server):
    from collections import Counter

    from trainer.channels.client import ShardClient

    shard, _ = running_job(shard_server)
    client = ShardClient(shard.server.address, 0, rank=0, trainer_id="t0", fingerprint=FP, counters=Counter())
    try:
        assert client.stats().job.job_id == JOB_ID
    finally:
        client.close()


def big_spec(megabytes: int):
    """A valid job spec of about ``megabytes`` MB: many one-element tensors with long names."""
    name_chars = 200
    n = (megabytes << 20) // (name_chars + 16)
    tensors = tuple((f"{i:08d}".ljust(name_chars, "x"), (1,), "float32") for i in range(n))
    return dataclasses.replace(make_spec(job_id=JOB_ID), total_params=n, tensors=tensors)


def test_ps_server_stats_reads_a_reply_over_grpcs_default_receive_limit(shard_server, capsys):
    """With a token every caller sees the spec: a 6 MB one makes a GetStats reply over gRPC's 4 MB default."""
    shard = shard_server(lease_timeout=0, security=ServerSecurity(token=TOKEN))
    spec = big_spec(6)
    address, security = shard.server.address, ClientSecurity(token=TOKEN)
    with security.channel(address) as channel:
        pb_grpc.ParameterServerStub(channel).Register(
            pb.RegisterRequest(rank=0, trainer_id="t0", job=spec.to_proto()), timeout=30)
    [reply] = fetch_stats([address], timeout=30, security=security)
    assert not isinstance(reply, Down), reply
    assert reply.ByteSize() > GRPC_DEFAULT_RECEIVE and len(reply.job.tensors) == len(spec.tensors)
    table = format_stats([address], [reply])
    assert "no shard answered" not in table and "DOWN" not in table and "sync" in table
    assert fetch_stat(address, timeout=30, security=security).job.job_id == JOB_ID


def test_stats_of_a_big_job_stay_small_for_a_caller_who_is_not_a_member(shard_server):
    shard = shard_server(lease_timeout=0)
    shard.register(rank=0, spec=big_spec(6))
    reply = shard.stub.GetStats(pb.StatsRequest(), timeout=30)
    assert not reply.HasField("job") and reply.ByteSize() < 64 << 10 and reply.mode == "sync"
    with grpc.insecure_channel(shard.server.address, options=STATS_CHANNEL_OPTIONS) as channel:  # the member's
        member = pb.StatsRequest(rank=0, trainer_id="t0", fingerprint=FP)
        assert pb_grpc.ParameterServerStub(channel).GetStats(member, timeout=30).job.job_id == JOB_ID
