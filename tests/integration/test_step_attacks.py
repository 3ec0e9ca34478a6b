"""An attacker's pass over the Step RPC on a real shard over gRPC: a stream is refused at the first message that
breaks the rules, not when (or if) the client ends it.  A stranger's Step at its first header; a part of chunks
under the minimum size at its second chunk (streamed, or packed into one message's ``more``); streams held open
by one rank count against --max-calls-per-rank; a stream that goes quiet is ended by --stream-idle-timeout.
Each refusal: one status, a message naming the field and both values, the shard's state digest unchanged, and
the shard still serving.  The attacking streams stay open (a generator blocked on an event) until the test ends,
so a refusal that only came at the stream's end would hang the call into its deadline and fail the test."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from psserver.serving.service import ServiceLimits
from tests.conftest import P
from tests.helpers import refused, wait_until
from tests.integration.test_sparse_rpc import rows_chunks
from tests.integration.test_step_rpc import dense, rows, started, step, table_reply, weights

CALL_TIMEOUT = 30  # only a shard that failed to refuse early waits this long


@pytest.fixture
def held_open():
    """``open_stream(msgs)``: the messages, then a stream that stays open until the test ends (released then)."""
    release = threading.Event()

    def open_stream(msgs):
        yield from msgs
        release.wait(CALL_TIMEOUT + 30)

    yield open_stream
    release.set()


def patient(shard_server, **limits):
    """A shard that ends an idle stream only after the test would have failed (so an early refusal is the
    shard's check, not its idle timer)."""
    return started(shard_server, limits=ServiceLimits(min_chunk_bytes=256, stream_idle_timeout=600, **limits))


def step_call(raw, requests):
    call = raw.channel.stream_stream(method("Step"), serialize_step, parse_step)
    return list(call(requests, timeout=CALL_TIMEOUT))


def still_serves(raw, sequence=1, single=False):
    """A whole step is applied; ``single``: sent as one message (no wait between reads for an idle timer)."""
    msgs = dense(raw, torch.ones(P), sequence=sequence) + rows(1, rows_chunks([1], seq=sequence), [1])
    if single:
        call = raw.channel.unary_stream(method("Step"), serialize_step, parse_step)
        got: dict[int, list] = {}
        for m in call(one_message(msgs), timeout=CALL_TIMEOUT):
            got.setdefault(m.part, []).append(m.dense if m.dense is not None else m.rows)
    else:
        got = step(raw, msgs)
    assert weights(got[0])[0].outcome == pb.APPLIED and table_reply(got[1])[0].outcome == pb.APPLIED


@pytest.mark.parametrize("who, code, fragment", [
    ("trainer_id", grpc.StatusCode.ALREADY_EXISTS, "rank 0 is registered as 't0', not 'x'"),
    ("fingerprint", grpc.StatusCode.FAILED_PRECONDITION, "fingerprint is 'eeeeeeeeeeeeeeee' but the job's is"),
])
def test_a_stranger_step_is_refused_at_its_first_header_while_its_stream_is_still_open(shard_server, held_open, who,
                                                                                        code, fragment):
    raw = patient(shard_server)
    stranger = {"trainer_id": "x"} if who == "trainer_id" else {"fingerprint": "e" * 16}
    first = dense(raw, torch.ones(P), **stranger)[:1]  # the first of the part's chunks, then nothing more
    refused(lambda: step_call(raw, held_open(first)), code, fragment, unchanged=raw)
    assert raw.stats().counters.get("step_calls", 0) == 0
    still_serves(raw)


def test_a_table_part_declaring_more_ids_than_the_cap_is_refused_at_its_header(shard_server, held_open):
    raw = patient(shard_server)
    part = rows(0, rows_chunks(list(range(100)), num_ids=(1 << 20) + 1, chunk_bytes=256))[:1]
    refused(lambda: step_call(raw, held_open(part)), grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"num_ids is {(1 << 20) + 1}, over the limit of {1 << 20}", unchanged=raw)
    still_serves(raw)


def _tiny_chunks(raw):
    """A dense part cut into chunks of one float each (4 bytes, under the shard's minimum of 256)."""
    h = raw.header(n=P, sequence=1)
    return [StepMessage(0, dense=c) for c in encode(wire_tensor(torch.ones(P), h.dtype), h, 4)]


@pytest.mark.parametrize("packing", ["streamed", "in one message"])
def test_a_part_of_chunks_under_the_minimum_is_refused_at_its_second_chunk(shard_server, held_open, packing):
    """Every chunk was kept until the stream ended -- a Python object or two for every 4 bytes sent -- and only
    then refused by the part's assembler; now the second chunk is refused as it arrives."""
    raw = patient(shard_server)
    tiny = _tiny_chunks(raw)
    msgs = tiny if packing == "streamed" else [one_message(tiny)]
    refused(lambda: step_call(raw, held_open(msgs)), grpc.StatusCode.INVALID_ARGUMENT,
            "part 0's chunk at offset 0 carries 4 bytes", "under the minimum of 256", unchanged=raw)
    still_serves(raw)


def test_a_table_part_of_chunks_under_the_minimum_is_refused_at_its_second_chunk(shard_server, held_open):
    raw = patient(shard_server)
    part = rows(0, rows_chunks(list(range(100)), chunk_bytes=1))  # one row (8 + 16 bytes) a chunk
    refused(lambda: step_call(raw, held_open(part)), grpc.StatusCode.INVALID_ARGUMENT,
            "part 0's chunk at offset 0 carries 24 bytes", "under the minimum of 256", unchanged=raw)
    still_serves(raw)


def test_step_streams_held_open_count_against_max_calls_per_rank(shard_server, held_open):
    """The slow loris: a member's Step streams opened and never finished.  Each holds one of its rank's calls
    from its first header on (it held none until it had been read whole), so a rank cannot pile them up past
    --max-calls-per-rank; the streams' own idle and total limits end them."""
    raw = patient(shard_server, max_calls_per_rank=2)
    call = raw.channel.stream_stream(method("Step"), serialize_step, parse_step)
    opened = [call(held_open(dense(raw, torch.ones(P), sequence=9)[:1]), timeout=CALL_TIMEOUT) for _ in range(2)]

    def third_refused():
        try:
            step(raw, dense(raw, torch.ones(P), sequence=1))  # applied (then duplicate) while a slot was free
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False

    wait_until(third_refused, what="a third Step of rank 0 to be refused while two are held open")
    before = raw.stats().counters.get("refused_over_limit", 0)
    refused(lambda: step(raw, dense(raw, torch.ones(P), sequence=1)), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rank 0 (--max-calls-per-rank) already has 2 calls in flight, the limit is 2", unchanged=raw)
    assert raw.stats().counters["refused_over_limit"] == before + 1
    for call in opened:
        call.cancel()
    wait_until(lambda: not third_refused(), what="rank 0's slots to be free once its held streams ended")


def test_a_step_stream_that_goes_quiet_is_deadline_exceeded_counted_and_changes_nothing(shard_server, held_open):
    raw = started(shard_server, limits=ServiceLimits(min_chunk_bytes=256, stream_idle_timeout=1.0))
    refused(lambda: step_call(raw, held_open(dense(raw, torch.ones(P), sequence=1)[:1])),
            grpc.StatusCode.DEADLINE_EXCEEDED, "no chunk arrived for", "--stream-idle-timeout", unchanged=raw)
    assert raw.stats().counters["refused_DEADLINE_EXCEEDED"] == 1
    still_serves(raw, single=True)


def _retiled(msgs, index, offset):
    chunk = msgs[index].dense if msgs[index].dense is not None else msgs[index].rows
    chunk.offset = offset
    return msgs


@pytest.mark.parametrize("case, fragment", [
    ("dense gap", "offset is 300 but 256 was expected"),
    ("dense overlap", "offset is 200 but 256 was expected"),
    ("rows gap", "chunk offset is 12 but 11 was expected"),
    ("rows overlap", "chunk offset is 10 but 11 was expected"),
])
def test_a_step_part_whose_chunks_leave_a_gap_or_overlap_is_refused_and_changes_nothing(shard_server, case, fragment):
    raw = started(shard_server)
    d, r = dense(raw, torch.ones(P), sequence=1), rows(1, rows_chunks(list(range(30)), chunk_bytes=256))
    assert len(d) == 4 and len(r) == 3  # 256 floats, 11 rows a chunk
    msgs = {"dense gap": lambda: _retiled(d, 1, 300) + r, "dense overlap": lambda: _retiled(d, 1, 200) + r,
            "rows gap": lambda: d + _retiled(r, 1, 12), "rows overlap": lambda: d + _retiled(r, 1, 10)}[case]()
    refused(lambda: step(raw, msgs), grpc.StatusCode.INVALID_ARGUMENT, fragment, unchanged=raw)
    still_serves(raw)


def test_a_step_message_whose_more_carries_more_of_its_own_is_invalid_argument_and_changes_nothing(shard_server):
    raw = started(shard_server)
    d, r = dense(raw, torch.ones(P), sequence=1), rows(1, rows_chunks([1]))
    nested = StepMessage(0, dense=d[0].dense, more=[one_message(d[1:] + r)])  # two levels: one is the most
    refused(lambda: step(raw, [nested]), grpc.StatusCode.INVALID_ARGUMENT, "malformed StepChunk message",
            "a chunk in `more` carries `more` of its own", unchanged=raw)
    still_serves(raw)
