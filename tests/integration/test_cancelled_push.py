"""A Push its client cancels before the shard read it whole, over real gRPC on loopback (issue 24 item 6).

gRPC ends a cancelled call's request stream on the shard as if the client had closed it, so such a push used to be
counted and logged as bad input (``refused_INVALID_ARGUMENT``, "the stream is empty").  Now it is counted as what it
is, ``calls_cancelled`` and ``streams_cancelled`` in GetStats, and logged; nothing of it is applied, and the shard
goes on serving.  A client that closes its stream early (and waits for the answer) is still refused.  Row pushes
(PushRows) the same way."""

import logging
import threading

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P
from tests.helpers import refused, wait_until
from tests.integration.test_refusals import _chunks, ready  # noqa: F401 (ready: the fixture)
from tests.integration.test_sparse_rpc import DIM, push_rows, rows_chunks, started


def _held_stream(chunks, gate: threading.Event):
    """``chunks``, then a stream that stays open until ``gate``: the client's side of a push in flight."""
    yield from chunks
    gate.wait(60)


@pytest.mark.parametrize("sent", [0, 1], ids=["before-any-chunk", "after-the-header-chunk"])
def test_a_push_cancelled_by_its_client_is_counted_cancelled_and_logged_not_refused_and_changes_nothing(
        ready, caplog, sent):
    caplog.set_level(logging.INFO, logger="psserver.serving.service")
    before = ready.digest()
    gate = threading.Event()
    try:
        call = ready.stub.Push.future(_held_stream(_chunks(ready)[:sent], gate), timeout=60)
        wait_until(lambda: ready.stats().counters["connections"] >= 1, "the shard to be reading the push")
        assert call.cancel()
        counters = wait_until(lambda: (c := ready.stats().counters)["streams_cancelled"] and c, "the count")
    finally:
        gate.set()
    assert counters["streams_cancelled"] == 1 and counters["calls_cancelled"] == 1
    assert "refused_INVALID_ARGUMENT" not in counters and counters["pushes_applied"] == 1  # the fixture's only
    assert "Push cancelled by its client" in caplog.text and "nothing of it applied" in caplog.text
    assert ready.digest() == before
    assert ready.push(torch.ones(P), version=1).outcome == pb.APPLIED  # it still serves


def test_a_step_cancelled_by_its_client_before_its_first_message_is_counted_cancelled_not_refused(ready, caplog):
    caplog.set_level(logging.INFO, logger="psserver.serving.service")
    before = ready.digest()
    gate = threading.Event()
    try:
        call = ready.stub.Step(_held_stream([], gate), timeout=60)  # a server stream: cancelled as an iterator
        wait_until(lambda: ready.stats().counters["connections"] >= 1, "the shard to be reading the step")
        call.cancel()
        counters = wait_until(lambda: (c := ready.stats().counters)["streams_cancelled"] and c, "the count")
    finally:
        gate.set()
    assert counters["calls_cancelled"] == 1 and "refused_INVALID_ARGUMENT" not in counters
    assert "Step cancelled by its client" in caplog.text
    assert ready.digest() == before


def test_a_push_stream_its_client_closes_early_is_still_refused_invalid_argument_and_changes_nothing(ready):
    refused(lambda: ready.push_chunks(_chunks(ready)[:1]), grpc.StatusCode.INVALID_ARGUMENT,
            "the chunks cover [0, 256) but the slice is [0, 1000)", unchanged=ready)
    counters = ready.stats().counters
    assert counters["refused_INVALID_ARGUMENT"] == 1 and "streams_cancelled" not in counters
    assert ready.push(torch.ones(P), version=1).outcome == pb.APPLIED


@pytest.mark.parametrize("sent", [0, 1], ids=["before-any-chunk", "after-the-header-chunk"])
def test_a_row_push_cancelled_by_its_client_is_counted_cancelled_not_refused_and_changes_nothing(
        shard_server, caplog, sent):
    caplog.set_level(logging.INFO, logger="psserver.serving.service")
    raw = started(shard_server, mode="async")
    before = raw.digest()
    chunks = rows_chunks(list(range(40)), grads=torch.ones(40, DIM), chunk_bytes=256)  # several chunks
    gate = threading.Event()
    try:
        call = raw.stub.PushRows.future(_held_stream(chunks[:sent], gate), timeout=60)
        wait_until(lambda: raw.stats().counters["connections"] >= 1, "the shard to be reading the row push")
        assert call.cancel()
        counters = wait_until(lambda: (c := raw.stats().counters)["streams_cancelled"] and c, "the count")
    finally:
        gate.set()
    assert counters["streams_cancelled"] == 1 and counters["calls_cancelled"] == 1
    assert "refused_INVALID_ARGUMENT" not in counters and counters["table.emb.pushes_applied"] == 0
    assert "PushRows cancelled by its client" in caplog.text and "nothing of it applied" in caplog.text
    assert raw.digest() == before
    assert push_rows(raw, rows_chunks([1, 2])).outcome == pb.APPLIED  # it still serves


def test_a_row_push_stream_its_client_closes_early_is_still_refused_invalid_argument_and_changes_nothing(
        shard_server):
    raw = started(shard_server, mode="async")
    chunks = rows_chunks(list(range(40)), grads=torch.ones(40, DIM), chunk_bytes=256)
    refused(lambda: push_rows(raw, chunks[:1]), grpc.StatusCode.INVALID_ARGUMENT, "the chunks cover ids [0,",
            "but num_ids is 40", unchanged=raw)
    counters = raw.stats().counters
    assert counters["refused_INVALID_ARGUMENT"] == 1 and "streams_cancelled" not in counters
    assert push_rows(raw, rows_chunks([1, 2])).outcome == pb.APPLIED
