"""Reply streams bounded in time and memory, and the caps on connections and health Watch streams, over real
gRPC on 127.0.0.1 (psserver/serving/replies.py; issue 20 findings 3 and 8).

A reader that stops reading is a channel whose receive window does not grow (``grpc.http2.bdp_probe`` off):
after its first chunk it reads nothing, so the shard's writes wait on HTTP/2 flow control.  The tests wait on
the shard's own counters and gauges (``reply_streams_cut``, ``reply_bytes_held``), never on a sleep.
"""

from __future__ import annotations

import contextlib

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.protocol import limits
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.rows.init import init_rows
from psserver.protocol.rows.table import TableSpec
from psserver.serving.service import ServiceLimits
from tests.conftest import make_spec
from tests.helpers import refused, wait_until
from trainer.channels.client import ShardedClient
import trainer.tables.row_pulls
import trainer.tables.row_pushes
from trainer.tables.sparse_client import ShardedRows

C = grpc.StatusCode
FP = "f" * 16
BIG = 1 << 20  # parameters: a 4 MiB reply, far past what flow control lets through to a reader that stalls
CHUNK = 64 << 10
SERVING = health_pb2.HealthCheckResponse.SERVING


def big_spec() -> JobSpec:
    return JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=BIG, fingerprint=FP,
                   optimizer=OptimizerConfig("sgd", lr=0.5), tensors=(("w", (BIG,), "float32"),))


def stalling_channel(address: str) -> grpc.Channel:
    """A connection of its own whose receive window stays small: a reader that stops reading stalls the shard's
    writes after a few chunks."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                   ("grpc.http2.bdp_probe", 0)])


def pull_request(min_version=0) -> pb.PullRequest:
    return pb.PullRequest(rank=0, trainer_id="t0", fingerprint=FP, min_version=min_version, dtype=pb.FLOAT32)


def big_shard(shard_server, **service):
    """A sync job of one trainer over BIG parameters, registered and initialised."""
    shard = shard_server(lease_timeout=0, chunk_bytes=CHUNK,
                         limits=ServiceLimits(min_chunk_bytes=256, **service))
    shard.register(spec=big_spec())
    h = shard.header(n=BIG)
    assert shard.stub.Init(encode(wire_tensor(torch.zeros(BIG), pb.FLOAT32), h, CHUNK), timeout=60).accepted
    return shard


def counters(shard) -> dict:
    return dict(shard.stats().counters)


def step(shard, version: int) -> None:
    """The trainer's push of a round: the shard steps (and moves parameters a stalled pull still streams)."""
    h = shard.header(n=BIG, version=version, sequence=version + 1)
    reply = shard.stub.Push(encode(wire_tensor(torch.ones(BIG), pb.FLOAT32), h, CHUNK), timeout=60)
    assert reply.outcome == pb.APPLIED


@contextlib.contextmanager
def stalled_pull(address: str, min_version=0):
    """A Pull whose reader took one chunk and reads no more; cancelled and closed whatever happens."""
    channel = stalling_channel(address)
    call = pb_grpc.ParameterServerStub(channel).Pull(pull_request(min_version), timeout=300)
    try:
        next(call)
        yield channel, call
    finally:
        call.cancel()
        channel.close()


def big_pull(shard) -> tuple[int, int]:
    chunks = list(shard.stub.Pull(pull_request(), timeout=60))
    return chunks[0].header.version, sum(len(c.data) for c in chunks)


# ---------------------------------------------------------------------------------------------- in time
def test_a_stalled_pull_reader_is_cut_at_max_call_seconds_and_what_it_held_is_released(shard_server):
    shard = big_shard(shard_server, max_call_seconds=2.0)
    before = shard.digest()
    with stalled_pull(shard.server.address) as (_, call):
        # the event: the shard cut the stream (counted), not a sleep past the deadline
        wait_until(lambda: counters(shard).get("reply_streams_cut", 0) == 1, "the shard to cut the stalled reply")
        # the snapshot is released; at most the one chunk gRPC could not send stays counted until the status is out
        assert counters(shard)["reply_bytes_held"] <= CHUNK
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:  # the reader reads again: the chunks gRPC had buffered, then the shard's status
                pass
        assert e.value.code() == C.DEADLINE_EXCEEDED
        assert "did not take the reply before the call's deadline" in e.value.details()
        assert "--max-call-seconds" in e.value.details()
    wait_until(lambda: counters(shard)["reply_bytes_held"] == 0, "the shard to hold no reply bytes")
    assert "refused_DEADLINE_EXCEEDED" not in counters(shard)  # a cut is counted as a cut, not as a refusal
    assert shard.digest() == before
    assert big_pull(shard) == (0, BIG * 4)  # the shard still serves a reader that reads
    step(shard, 0)


def test_a_pull_within_its_time_is_not_cut_and_holds_nothing_after(shard_server):
    shard = big_shard(shard_server, max_call_seconds=600.0)
    assert big_pull(shard) == (0, BIG * 4)
    c = counters(shard)
    assert c.get("reply_streams_cut", 0) == 0 and c["reply_bytes_held"] == 0 and c["connections"] == 0


# ---------------------------------------------------------------------------------------------- in memory
def test_a_second_unread_snapshot_on_one_connection_past_its_cap_is_refused_and_changes_nothing(shard_server):
    shard = big_shard(shard_server, max_reply_bytes_per_peer=6 << 20)
    with stalled_pull(shard.server.address) as (channel, _):
        wait_until(lambda: counters(shard)["reply_bytes_held"] == BIG * 4, "the stalled pull to hold its snapshot")
        step(shard, 0)  # parameters move aside: the stalled pull keeps version 0's buffer
        before = shard.digest()
        stub = pb_grpc.ParameterServerStub(channel)
        refused(lambda: list(stub.Pull(pull_request(min_version=1), timeout=60)), C.RESOURCE_EXHAUSTED,
                "holds 4.0 MiB of unread replies; 4.0 MiB more would pass the cap of 6.0 MiB",
                "--max-reply-bytes-per-peer")
        assert shard.digest() == before
        assert counters(shard)["reply_bytes_held"] == BIG * 4
        assert big_pull(shard) == (1, BIG * 4)  # another connection is served meanwhile
    wait_until(lambda: counters(shard)["reply_bytes_held"] == 0, "the cancelled pull to release its snapshot")
    assert counters(shard)["refused_RESOURCE_EXHAUSTED"] == 1


def test_an_unread_snapshot_past_the_shards_cap_is_refused_until_it_is_released(shard_server):
    shard = big_shard(shard_server, max_reply_bytes=6 << 20)
    with stalled_pull(shard.server.address):
        wait_until(lambda: counters(shard)["reply_bytes_held"] == BIG * 4, "the stalled pull to hold its snapshot")
        step(shard, 0)
        before = shard.digest()
        refused(lambda: big_pull(shard), C.RESOURCE_EXHAUSTED,
                "the shard holds 4.0 MiB of unread replies; 4.0 MiB more would pass the cap of 6.0 MiB",
                "--max-reply-bytes")
        assert shard.digest() == before
    wait_until(lambda: counters(shard)["reply_bytes_held"] == 0, "the cancelled pull to release its snapshot")
    assert big_pull(shard) == (1, BIG * 4)


# ---------------------------------------------------------------------------------------------- connections
def test_a_call_from_a_connection_past_max_connections_is_refused_and_health_still_answers(shard_server):
    shard = big_shard(shard_server, max_connections=1)
    with stalled_pull(shard.server.address):  # one connection with a call in flight
        wait_until(lambda: counters(shard)["connections"] == 1, "the stalled pull's connection to be counted")
        before = shard.digest()
        refused(lambda: big_pull(shard), C.RESOURCE_EXHAUSTED,
                "1 connections have calls in flight, the limit is 1 (--max-connections)")
        assert health_pb2_grpc.HealthStub(shard.channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=10).status == SERVING
        assert shard.digest() == before
        assert counters(shard)["refused_connections"] == 1
    wait_until(lambda: counters(shard)["connections"] == 0, "the cancelled pull's connection to be free")
    assert big_pull(shard) == (0, BIG * 4)


def test_health_watch_streams_past_their_cap_are_refused_and_check_still_answers(shard_server):
    shard = shard_server(limits=ServiceLimits(min_chunk_bytes=256, max_watch_streams=2))
    health = health_pb2_grpc.HealthStub(shard.channel)
    before = shard.digest()
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=300) for _ in range(2)]
    try:
        for w in watches:
            assert next(w).status == SERVING
        assert counters(shard)["watch_streams"] == 2
        refused(lambda: next(health.Watch(health_pb2.HealthCheckRequest(), timeout=60)), C.RESOURCE_EXHAUSTED,
                "2 health Watch streams are open, the limit is 2 (--max-watch-streams)")
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        assert counters(shard)["refused_watch_streams"] == 1
        assert shard.digest() == before
    finally:
        for w in watches:
            w.cancel()
    wait_until(lambda: counters(shard)["watch_streams"] == 0, "the cancelled Watch streams to be forgotten")
    w = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
    try:
        assert next(w).status == SERVING
    finally:
        w.cancel()


def test_the_loop_watchdog_is_in_getstats(shard_server):
    shard = shard_server()
    c = counters(shard)
    assert c["loop_stall_seconds"] >= 0 and c["loop_stall_worst_seconds"] >= c["loop_stall_seconds"]


# ---------------------------------------------------------------------------------------------- PullRows' cap
DIM = 16


def test_a_row_pull_past_the_reply_cap_is_refused_and_the_trainer_splits_its_pulls(shard_server, monkeypatch):
    cap = 100 * DIM * 4  # 100 rows a call
    monkeypatch.setattr(limits, "MAX_ROWS_REPLY_BYTES", cap)
    monkeypatch.setattr(trainer.tables.row_pulls, "MAX_ROWS_REPLY_BYTES", cap)
    monkeypatch.setattr(trainer.tables.row_pushes, "MAX_ROWS_REPLY_BYTES", cap)
    spec = make_spec(tables=(TableSpec("emb", DIM, seed=7),))
    shard = shard_server(lease_timeout=0)
    client = ShardedClient([shard.server.address], spec, 0, "t0")
    rows = ShardedRows(client, spec)
    try:
        client.shards[0].registrar.register(spec, connect_timeout=10)
        ids = torch.arange(1000, dtype=torch.int64) * 7919
        pulled = rows.pull("emb", ids)
        assert torch.equal(pulled, init_rows(spec.tables[0].initializer, 7, ids, DIM))
        assert rows.counters["row_pull_calls"] == 10
        req = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="emb", ids=ids.numpy().tobytes())
        before = shard.digest()
        refused(lambda: list(shard.stub.PullRows(req, timeout=30)), C.RESOURCE_EXHAUSTED,
                f"asks for 1000 rows of dim {DIM} (64000 bytes), over this shard's limit of {cap} bytes")
        assert shard.digest() == before
        assert torch.equal(rows.pull("emb", ids), pulled)
        assert counters(shard)["reply_bytes_held"] == 0
    finally:
        rows.close()
        client.close()
