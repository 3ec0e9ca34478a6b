"""A big Register job spec is read on a thread holding a call of its connection and the shard's one turn until the
read ends -- also when its client cancels the call (docs/design/attacks-2026-11-25.md, review follow-up)."""

from __future__ import annotations

import threading

import grpc

from psserver.serving import service, service_common
from psserver.serving.service import ServiceLimits
from tests.conftest import RawShard
from tests.helpers import refused
from tests.integration.test_step_attacks import CALL_TIMEOUT, still_serves
from tests.integration.test_step_rpc import started
from tests.integration.test_wire_attacks import _big_spec_register


def test_a_cancelled_big_spec_register_holds_its_call_and_the_turn_until_its_read_on_the_thread_ends(shard_server,
                                                                                                     monkeypatch):
    """Before: the cancel released the connection's call and the turn at once while the thread read on (~1 s of
    CPU, the 14 MB request kept), so a client sending and cancelling in a loop queued reads without bound.  Here the
    read is held (an event): after the cancel a second big spec on the same connection is refused by
    --max-calls-per-peer, one on another connection waits for the turn, and both reads happen one at a time."""
    raw = started(shard_server, limits=ServiceLimits(min_chunk_bytes=256, max_calls_per_peer=1))
    lock, reading, peak = threading.Lock(), [0], [0]
    entered, release, cancelled = threading.Semaphore(0), threading.Event(), threading.Event()
    real_parse, real_cancelled = service._parse_job, service_common._cancelled

    def held(proto):
        if len(proto.tensors) > service.BIG_SPEC_TENSORS:
            with lock:
                reading[0] += 1
                peak[0] = max(peak[0], reading[0])
            entered.release()
            try:
                release.wait(CALL_TIMEOUT + 30)
            finally:
                with lock:
                    reading[0] -= 1
        return real_parse(proto)

    def seen_cancelled(*args):
        real_cancelled(*args)
        cancelled.set()  # the handler's task ended cancelled (what it held in its frames is given back by now)

    monkeypatch.setattr(service, "_parse_job", held)
    monkeypatch.setattr(service_common, "_cancelled", seen_cancelled)
    other = RawShard(raw.server)  # a connection of its own
    try:
        _one_at_a_time(raw, other, entered, cancelled, release)
        assert peak[0] == 1, f"{peak[0]} big specs read at once on threads"
    finally:
        other.close()
    still_serves(raw)


def _one_at_a_time(raw, other, entered, cancelled, release) -> None:
    try:
        first = _big_spec_register(raw, "big0")
        assert entered.acquire(timeout=CALL_TIMEOUT), f"the first read never started ({first.exception()})"
        first.cancel()
        assert cancelled.wait(CALL_TIMEOUT), "the shard never saw the cancel"
        refused(lambda: _big_spec_register(raw, "big1").result(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "already has 1 call in flight, the limit is 1 (--max-calls-per-peer)", unchanged=raw)
        waiting = _big_spec_register(other, "big2")  # waits for the turn the cancelled call's read holds
    finally:
        release.set()
    refused(waiting.result, grpc.StatusCode.FAILED_PRECONDITION, "job spec differs")
    # the cancelled call's read has ended (the turn came to `waiting` after it): its connection's call is back
    refused(lambda: _big_spec_register(raw, "big3").result(), grpc.StatusCode.FAILED_PRECONDITION, "job spec differs")
