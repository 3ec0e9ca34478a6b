"""The push window's bookkeeping with fake pushes: no network, no threads (each push settles when told)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from tests.helpers import wait_until

from trainer.tables.push_window import PushWindow, WindowFailed


class FakeSends:
    """Starts nothing: each started send waits until the test settles it, in any order."""

    def __init__(self):
        self.started: list[tuple[object, Future]] = []

    def start(self, send):
        f = Future()
        self.started.append((send, f))
        return f

    def ack(self, i: int) -> None:
        send, f = self.started[i]
        f.set_result(send())

    def fail(self, i: int, error: Exception) -> None:
        self.started[i][1].set_exception(error)


def wait_for(condition) -> None:
    wait_until(condition, "the window's thread to get there")


def numbered(n):
    return lambda: ("ack", n)


def test_window_fills_to_w_minus_one_without_waiting_and_counts_what_is_in_flight():
    fake, acks = FakeSends(), []
    w = PushWindow(4, fake.start, on_ack=lambda n, r: acks.append((n, r)))
    for n in range(3):
        assert w.submit(numbered(n)) == n + 1
    assert w.in_flight == 3 and w.stats.full_waits == 0 and w.stats.max_in_flight == 3 and acks == []


def test_a_full_window_blocks_until_one_push_is_acknowledged_never_more_than_w_on_the_wire():
    fake = FakeSends()
    w = PushWindow(3, fake.start)
    w.submit(numbered(0))
    w.submit(numbered(1))
    done = threading.Event()
    t = threading.Thread(target=lambda: (w.submit(numbered(2)), done.set()))
    t.start()
    wait_for(lambda: len(fake.started) == 3)  # the third is sent, then waits for room
    assert not done.is_set() and w.in_flight == 3 and w.stats.max_in_flight == 3
    fake.ack(1)  # a later push acknowledged first frees a place too
    t.join(timeout=10)
    assert done.is_set() and w.stats.full_waits == 1 and w.in_flight == 2


def test_drain_waits_for_every_push_and_reports_each_acknowledgement_once():
    fake, acks = FakeSends(), []
    w = PushWindow(4, fake.start, on_ack=lambda n, r: acks.append(n))
    for n in range(3):
        w.submit(numbered(n))
    t = threading.Thread(target=w.drain)
    t.start()
    for i in (2, 0, 1):
        fake.ack(i)
    t.join(timeout=10)
    assert not t.is_alive() and w.in_flight == 0 and sorted(acks) == [1, 2, 3] and w.stats.acknowledged == 3


def test_a_failed_push_keeps_its_place_and_is_retried_with_the_same_send():
    fake, acks = FakeSends(), []
    w = PushWindow(3, fake.start, on_ack=lambda n, r: acks.append(r))
    first, second = numbered("seq-7"), numbered("seq-8")
    w.submit(first)
    w.submit(second)
    fake.fail(0, ConnectionError("reply lost"))
    fake.ack(1)
    with pytest.raises(WindowFailed, match=r"1 push\(es\) of the window failed \(1\)"):
        w.drain()
    assert w.in_flight == 1 and [p.number for p in w.failed()] == [1]
    assert w.retry_failed() == 1
    assert fake.started[2][0] is first  # sent again as it was: the same sequence numbers
    fake.ack(2)
    w.drain()
    assert acks == [("ack", "seq-8"), ("ack", "seq-7")] and w.in_flight == 0 and w.stats.retried == 1


def test_a_failure_is_raised_before_a_new_push_is_sent_and_a_window_of_failures_never_hangs():
    fake = FakeSends()
    w = PushWindow(1, fake.start)
    with pytest.raises(WindowFailed):
        fake_fail_on_start(fake, w)
    with pytest.raises(WindowFailed):  # full of failures: raised again, not waited on
        w.submit(numbered(1))
    assert len(fake.started) == 1
    assert w.abandon_failed() == [1] and w.in_flight == 0 and w.stats.abandoned == 1


def fake_fail_on_start(fake: FakeSends, w: PushWindow) -> None:
    original = fake.start

    def failing(send):
        f = original(send)
        f.set_exception(TimeoutError("deadline"))
        return f

    w._start = failing
    try:
        w.submit(numbered(0))  # W=1: waits for its own acknowledgement, which failed
    finally:
        w._start = original


def test_window_of_one_returns_only_after_its_own_push_was_acknowledged():
    acks = []
    w = PushWindow(1, lambda fn: _done(fn), on_ack=lambda n, r: acks.append(n))
    w.submit(numbered(0))
    assert acks == [1] and w.in_flight == 0


def _done(fn) -> Future:
    f = Future()
    f.set_result(fn())
    return f


def test_a_window_below_one_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="push_window is 0 but must be 1 or more"):
        PushWindow(0, _done)
