"""The attack pass of 2026-11-25 on a real shard over gRPC (docs/design/attacks-2026-11-25.md): messages whose parse cost
grows with their count of fields, a Step part carrying more than its header declares, and request streams closed
early at a high rate.  Each refusal: one status, a message naming the field and both values, the shard's state
digest unchanged, and the shard still serving.  Streams that should be refused before their end stay open (a
generator blocked on an event) until the test ends, so a refusal that came only at the stream's end would hang
the call into its deadline and fail the test."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from psserver.state import metrics_http

from psserver.protocol import limits
from psserver.protocol.fastwire import MAX_CHUNK_FIELDS
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from psserver.serving import service, service_common
from psserver.serving.service import ServiceLimits
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until
from tests.integration.test_sparse_rpc import rows_chunks
from tests.integration.test_step_attacks import CALL_TIMEOUT, held_open, patient, step_call, still_serves  # noqa: F401
from tests.integration.test_step_rpc import dense, rows, started, step


def _raw_call(raw, name: str, kind: str):
    """A call of ``name`` that sends bytes as they are (no serializer: the message is the attacker's own)."""
    reply = parse_step if name.startswith("Step") else pb.PushReply.FromString
    return getattr(raw.channel, kind)(method(name), lambda b: b, reply)


def test_a_push_message_of_more_fields_than_a_chunk_has_is_invalid_argument_at_its_parse(shard_server):
    """Before: 16 MiB of two-byte fields (an unknown varint, repeated) was parsed field by field on the shard's
    event loop before any check of the caller -- seconds of loop time from anyone who reaches the port."""
    raw = started(shard_server)
    push = _raw_call(raw, "Push", "stream_unary")
    refused(lambda: push(iter([b"\x20\x00" * (1 << 20)]), timeout=CALL_TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT,
            "malformed Chunk message", f"more than {MAX_CHUNK_FIELDS} fields", "in 2097152 bytes", unchanged=raw)
    still_serves(raw)


@pytest.mark.parametrize("body, fragment", [
    (b"\x22\x00" * (limits.MAX_STEP_MESSAGE_CHUNKS + 1),
     f"`more` carries more than {limits.MAX_STEP_MESSAGE_CHUNKS} chunks"),
    (b"\x08\x00" * (MAX_CHUNK_FIELDS + 1), f"more than {MAX_CHUNK_FIELDS} fields besides `more`"),
], ids=["more-entries", "repeated-part"])
def test_a_step_once_message_past_its_parse_caps_is_invalid_argument_at_its_parse(shard_server, body, fragment):
    """Before: each empty `more` entry became a StepMessage (8M of them in a 16 MiB message), then refused."""
    raw = started(shard_server)
    once = _raw_call(raw, "StepOnce", "unary_unary")
    refused(lambda: once(body, timeout=CALL_TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT, "malformed StepChunk message",
            fragment, unchanged=raw)
    assert raw.stats().counters.get("step_calls", 0) == 0
    still_serves(raw, single=True)


def _extra_dense(n: int, start: int):
    """``n`` more dense chunks of 1,000 floats past the slice's end (the shard's slice is P = 1,000 floats)."""
    return [StepMessage(0, dense=pb.Chunk(offset=start + i * 1000, data=b"\0" * 4000)) for i in range(n)]


def test_a_dense_part_carrying_more_than_its_header_declares_is_refused_at_the_chunk_past_it(shard_server,
                                                                                             held_open):
    """Before: a Step's part was bounded only by the stream's --max-push-bytes (4 GiB by default), whatever its
    header declared: a member's dense part of a 4 KB slice brought megabytes, all kept until the stream ended."""
    raw = patient(shard_server)
    msgs = dense(raw, torch.ones(P), sequence=1) + _extra_dense(64, P)  # 4,000 bytes declared, 260,000 sent
    refused(lambda: step_call(raw, held_open(msgs)), grpc.StatusCode.INVALID_ARGUMENT,
            f"part 0 carries {P * 4 + 4000} bytes so far but its header declares {P * 4} bytes", unchanged=raw)
    assert raw.stats().counters.get("step_calls", 0) == 0
    still_serves(raw)


def test_a_table_part_whose_first_chunk_carries_more_rows_than_num_ids_is_refused_at_that_chunk(shard_server,
                                                                                                held_open):
    raw = patient(shard_server)
    part = rows(0, rows_chunks(list(range(20)), num_ids=1))  # 20 rows of dim 4 in one chunk, 1 declared
    refused(lambda: step_call(raw, held_open(part)), grpc.StatusCode.INVALID_ARGUMENT,
            "part 0 carries 480 bytes so far but its header declares 24 bytes", unchanged=raw)
    still_serves(raw)


@pytest.fixture
def grace_entered(monkeypatch):
    """``(entered, cancellations)``: an event set when a stream that ended early starts waiting for its call's
    cancellation (service_common._client_cancelled), whose wait is made long enough that the test decides its
    end by cancelling the call."""
    entered = threading.Event()
    real = service_common._client_cancelled
    monkeypatch.setattr(service_common, "CANCEL_GRACE", CALL_TIMEOUT + 30)

    async def marked(context):
        entered.set()
        return await real(context)

    monkeypatch.setattr(service_common, "_client_cancelled", marked)
    return entered


def test_a_stream_waiting_out_its_cancel_grace_holds_a_call_of_its_connection(shard_server, grace_entered):
    """Before: a stream closed early gave its connection's call back and then waited CANCEL_GRACE (1 s) outside
    --max-calls-per-peer, holding what it had read (a Step's parts), so a client closing streams early at a high
    rate held handlers and memory past every cap.  Now the wait holds a call of the connection."""
    raw = started(shard_server, limits=ServiceLimits(min_chunk_bytes=256, max_calls_per_peer=1))
    early = raw.stub.Push.future(iter(dense(raw, torch.ones(P), sequence=1)[0].dense for _ in range(1)),
                                 timeout=CALL_TIMEOUT)  # the header chunk, then the stream closes
    try:
        assert grace_entered.wait(CALL_TIMEOUT), "the shard never waited for the early stream's cancellation"
        refused(lambda: raw.push(torch.ones(P), version=0, sequence=1), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "already has 1 call in flight, the limit is 1 (--max-calls-per-peer)", unchanged=raw)
    finally:
        early.cancel()
    counters = wait_until(lambda: (c := raw.stats().counters).get("streams_cancelled") and c, "the early stream's end")
    assert counters["calls_cancelled"] == 1 and "refused_INVALID_ARGUMENT" not in counters
    assert raw.push(torch.ones(P), version=0, sequence=1).outcome == pb.APPLIED  # the connection's call is back


def test_a_step_once_whose_dense_part_is_short_is_refused_without_waiting_for_a_cancellation(shard_server,
                                                                                            grace_entered):
    """A unary call's request came whole: a short part in it is bad input, never a cancelled stream, so it is
    refused at once (it waited CANCEL_GRACE holding the request, outside the connection's calls)."""
    raw = started(shard_server)
    once = raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)
    refused(lambda: once(one_message(dense(raw, torch.ones(P), sequence=1)[:1]), timeout=CALL_TIMEOUT),
            grpc.StatusCode.INVALID_ARGUMENT, "the chunks cover [0, 256) but the slice is [0, 1000)", unchanged=raw)
    assert not grace_entered.is_set()
    still_serves(raw, single=True)


def test_a_step_dense_part_naming_moved_from_is_invalid_argument_not_applied_as_a_push(shard_server):
    """Before: a Step's dense part naming an old slot (``moved_from``, a question that carries no gradient) was
    applied as an ordinary push -- a trainer asking whether its push was applied would have applied it again."""
    raw = started(shard_server)
    msgs = dense(raw, torch.ones(P), sequence=1)
    msgs[0].dense.header.moved_from = 3
    refused(lambda: step(raw, msgs), grpc.StatusCode.INVALID_ARGUMENT, "moved_from is 3 but a Step's dense part",
            unchanged=raw)
    assert raw.stats().counters.get("step_calls", 0) == 0
    still_serves(raw)


def test_a_moved_question_with_an_overlong_trainer_id_is_invalid_argument_as_any_push(shard_server):
    """Before: a Push naming ``moved_from`` skipped the header's bounds (ids, sequence, num_samples)."""
    raw = started(shard_server)
    h = raw.header(n=0, sequence=1, trainer_id="x" * 200)
    h.moved_from = 7
    refused(lambda: raw.push_chunks([pb.Chunk(header=h)]), grpc.StatusCode.INVALID_ARGUMENT,
            "trainer_id is 200 characters long, over the limit of 128", unchanged=raw)
    still_serves(raw)


def _scrape(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        return b"".join(iter(lambda: s.recv(1 << 16), b"")).decode()


def _closed_by_the_server(s: socket.socket) -> bool:
    s.settimeout(CALL_TIMEOUT)  # (a server that never closes it fails the test here, not hangs it)
    return s.recv(1) == b""


def test_metrics_port_connections_past_the_limit_are_closed_at_once_counted_and_idle_ones_are_closed(shard_server):
    """Before: prometheus_client's server held a thread for every connection for as long as it stayed open -- 300
    connections that sent half a request line held 300 threads of the shard's process."""
    raw = started(shard_server)
    port = raw.server.shard.metrics.serve(0, "127.0.0.1", max_connections=2, request_seconds=CALL_TIMEOUT + 30)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        for s in held:
            s.sendall(b"GET /metr")  # half a request line: each holds its thread
        extra = socket.create_connection(("127.0.0.1", port))
        with extra:
            assert _closed_by_the_server(extra)
    finally:
        for s in held:
            s.close()
    refused_total = wait_until(lambda: _refused_total(port), "a scrape once the held connections closed")
    assert refused_total >= 1  # the extra one (and any scrape here that came before a held thread had ended)
    still_serves(raw)


def _refused_total(port: int) -> float | None:
    """The refused-connections counter a scrape reads, or None if this scrape's connection was itself refused."""
    for line in _scrape(port).splitlines():
        if line.startswith("psgrpc_metrics_connections_refused_total "):
            return float(line.split()[1])
    return None


def test_a_metrics_connection_that_sends_nothing_is_closed_after_the_idle_time():
    port = metrics_http.serve(CollectorRegistry(), 0, "127.0.0.1", request_seconds=0.5)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /metr")
        assert _closed_by_the_server(s)


def _big_spec_register(raw, trainer_id: str):
    """A Register of a spec of BIG_SPEC_TENSORS + 1 tensors (another job's: refused once it is read)."""
    spec = make_spec().to_proto()
    del spec.tensors[:]
    for i in range(service.BIG_SPEC_TENSORS + 1):
        spec.tensors.add(name=f"w{i}", shape=[1], dtype="float32")
    spec.total_params = service.BIG_SPEC_TENSORS + 1
    return raw.stub.Register.future(pb.RegisterRequest(rank=0, trainer_id=trainer_id, job=spec), timeout=CALL_TIMEOUT)


def test_a_big_job_spec_is_read_off_the_event_loop_one_at_a_time_holding_a_call_of_its_connection(shard_server,
                                                                                                  monkeypatch):
    """Before: JobSpec.from_proto ran on the event loop -- 0.9 to 1.1 s for 60,000 tensors (13.8 MB), from anyone
    who reaches the port, as often as it likes.  Here the read is held (an event) to show the loop answering
    meanwhile, and a second big spec on the same connection refused by --max-calls-per-peer."""
    raw = started(shard_server, limits=ServiceLimits(min_chunk_bytes=256, max_calls_per_peer=1))
    reading, release = threading.Event(), threading.Event()
    real = service._parse_job

    def held(proto):
        if len(proto.tensors) > service.BIG_SPEC_TENSORS:
            reading.set()
            release.wait(CALL_TIMEOUT + 30)
        return real(proto)

    monkeypatch.setattr(service, "_parse_job", held)
    first = _big_spec_register(raw, "big")
    try:
        assert reading.wait(CALL_TIMEOUT), "the big spec was never read"
        assert raw.stats().version == 0  # the loop answers while the spec is read
        refused(lambda: _big_spec_register(raw, "big2").result(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "already has 1 call in flight, the limit is 1 (--max-calls-per-peer)", unchanged=raw)
    finally:
        release.set()
    refused(first.result, grpc.StatusCode.FAILED_PRECONDITION, "job spec differs", unchanged=raw)
    still_serves(raw)
