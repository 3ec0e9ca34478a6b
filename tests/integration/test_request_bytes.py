"""Bytes held by requests being received are bounded across calls (issue 35 item 2), on a real shard on loopback.

A client that opens row pushes or Step streams and leaves them unfinished made the shard hold what their headers
declared (a PushRows' receive buffer) or what they sent (a Step's parts, kept until the stream ends) with no bound
but --max-push-bytes a call: three held 400 MB pushes grew the shard by 1.3 GB.  Now every such byte is held in
the shard's request ledger (psserver.serving.replies.RequestLedger) from before its buffer is allocated until the call
ends; a call past --max-request-bytes-per-peer (its connection's) or --max-request-bytes (the shard's) is refused
RESOURCE_EXHAUSTED naming the cap, the state unchanged, and the shard goes on serving once the streams end.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.stepwire import StepMessage, parse_step, serialize_step
from psserver.protocol.stubs import method
from psserver.serving.service import ServiceLimits
from tests.conftest import P
from tests.helpers import refused, wait_until
from tests.integration.test_sparse_rpc import DIM, job, push_rows, rows_chunks

HELD_IDS = 20_000  # a declared push of 20,000 rows of dim 4: 480,000 bytes held (ids and rows)
HELD = HELD_IDS * (4 * DIM + 8)
PEER_CAP, SHARD_CAP = HELD + HELD // 2, 2 * HELD + HELD // 2  # one held push fits a connection, two the shard


def shard(shard_server):
    raw = shard_server(limits=ServiceLimits(min_chunk_bytes=256, max_request_bytes_per_peer=PEER_CAP,
                                            max_request_bytes=SHARD_CAP))
    raw.register(spec=job(mode="async", num_embeddings=1 << 20))
    raw.init(torch.zeros(P))
    return raw


def held(raw) -> float:
    return raw.stats().counters.get("request_bytes_held", 0)


class HeldPush:
    """A PushRows declaring HELD_IDS rows whose first chunk is sent and the rest never: its stream stays open
    (on ``channel``, a connection of its own or a shared one) until ``end``."""

    def __init__(self, channel, sequence: int):
        self._go = threading.Event()
        first = rows_chunks(list(range(16)), seq=sequence, num_ids=HELD_IDS, chunk_bytes=1 << 20)[0]
        stub = pb_grpc.ParameterServerStub(channel)

        def chunks():
            yield first
            self._go.wait(60)

        self.error = None
        self._thread = threading.Thread(target=self._call, args=(stub, chunks()))
        self._thread.start()

    def _call(self, stub, chunks):
        try:
            stub.PushRows(chunks, timeout=60)
        except grpc.RpcError as e:
            self.error = e

    def end(self):
        self._go.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


def test_a_row_push_past_its_connections_cap_on_held_request_bytes_is_refused_and_changes_nothing(shard_server):
    raw = shard(shard_server)
    first = HeldPush(raw.channel, sequence=1)
    try:
        wait_until(lambda: held(raw) >= HELD, "the first push's declared rows to be held")
        refused(lambda: push_rows(raw, rows_chunks(list(range(20, 40)), seq=2, num_ids=HELD_IDS)),
                grpc.StatusCode.RESOURCE_EXHAUSTED, "of requests being received", "--max-request-bytes-per-peer",
                unchanged=raw)
    finally:
        first.end()
    wait_until(lambda: held(raw) == 0, "the ended stream's bytes to be given back")
    assert first.error is not None and first.error.code() == grpc.StatusCode.INVALID_ARGUMENT  # (it ended early)
    assert push_rows(raw, rows_chunks([1, 2], seq=3)).outcome == pb.APPLIED  # still serving
    assert raw.stats().counters["refused_RESOURCE_EXHAUSTED"] == 1


def test_held_pushes_on_several_connections_pass_the_shards_cap_and_the_next_is_refused_naming_it(shard_server):
    raw = shard(shard_server)
    channels = [grpc.insecure_channel(raw.server.address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(3)]
    pushes = []
    try:
        for k, ch in enumerate(channels[:2]):
            pushes.append(HeldPush(ch, sequence=k + 1))
            wait_until(lambda n=k + 1: held(raw) >= n * HELD, f"push {k + 1}'s declared rows to be held")
        third = pb_grpc.ParameterServerStub(channels[2])
        refused(lambda: third.PushRows(iter(rows_chunks(list(range(20, 40)), seq=3, num_ids=HELD_IDS)), timeout=10),
                grpc.StatusCode.RESOURCE_EXHAUSTED, "the shard holds", "--max-request-bytes)", unchanged=raw)
    finally:
        for p in pushes:
            p.end()
        for ch in channels:
            ch.close()
    wait_until(lambda: held(raw) == 0, "the ended streams' bytes to be given back")


@pytest.mark.parametrize("call", ["Step", "StepOnce"])
def test_a_step_past_its_connections_cap_is_refused_before_any_part_runs(shard_server, call):
    raw = shard(shard_server)
    first = HeldPush(raw.channel, sequence=1)
    try:
        wait_until(lambda: held(raw) >= HELD, "the push's declared rows to be held")
        # a Step whose one message carries a table part as big as the held push
        rows = rows_chunks(list(range(HELD_IDS)), seq=2, chunk_bytes=1 << 30)
        msg = StepMessage(0, rows=rows[0])
        if call == "Step":
            stub = raw.channel.stream_stream(method("Step"), serialize_step, parse_step)
            fn = lambda: list(stub(iter([msg]), timeout=10))  # noqa: E731
        else:
            stub = raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)
            fn = lambda: stub(msg, timeout=10)  # noqa: E731
        refused(fn, grpc.StatusCode.RESOURCE_EXHAUSTED, "of requests being received", unchanged=raw)
    finally:
        first.end()
    assert raw.stats().counters.get("table.emb.pushes_applied", 0) == 0
