"""The shard's per-call fixed costs cut in issue 21, without a network: where Runtime.run_state runs a call (on
the loop for a slice under the bound, else on the state worker), what the worker hands back (a result, an
exception, nothing for a call cancelled before it started) -- for run_state and Runtime.offload alike --, and the request stream's one idle timer, decided
on a fake clock."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from psserver.protocol.errors import StreamTimeout
from psserver.serving.runtime import INLINE_STATE_ELEMENTS, Runtime
from psserver.serving.service_common import _StreamReader


def runtime_for(loop: asyncio.AbstractEventLoop, slice_length: int, inline_elements: int,
                checkpoint_every: int = 0) -> Runtime:
    """A runtime over one partition at version 7; ``checkpoint_every`` N: a checkpoint is due at multiples of N."""
    due = (lambda v: v % checkpoint_every == 0) if checkpoint_every else (lambda v: False)
    host = SimpleNamespace(shard_id=0, parts=[SimpleNamespace(slice_length=lambda: slice_length, version=7,
                                                              checkpoints=SimpleNamespace(due=due))])
    rt = Runtime(host, SimpleNamespace(loop=loop, loop_thread=threading.get_ident()), receive_buffers=1)
    rt.inline_elements = inline_elements
    return rt


def run_on_loop(slice_length: int, inline_elements: int, scenario, checkpoint_every: int = 0):
    async def main():
        rt = runtime_for(asyncio.get_running_loop(), slice_length, inline_elements, checkpoint_every)
        try:
            return await scenario(rt)
        finally:
            rt.shutdown()
    return asyncio.run(main())


def test_a_slice_under_the_bound_runs_its_call_on_the_loop_and_one_over_it_on_the_state_worker():
    async def where(rt):
        return await rt.run_state(threading.get_ident), threading.get_ident()

    ran, loop = run_on_loop(100_000, 1 << 18, where)
    assert ran == loop
    ran, loop = run_on_loop(100_000, INLINE_STATE_ELEMENTS, where)
    assert ran != loop


@pytest.mark.parametrize("every, on_loop", [(8, False), (3, True), (0, True)])
def test_a_call_whose_step_may_take_a_due_checkpoint_runs_on_the_state_worker(every, on_loop):
    """The capture copies every table's rows (~1 s at 1M rows): a call that may make version 8 runs on the
    worker when a checkpoint is due at 8 (every 8), on the loop when not (every 3: due at 6 and 9; no checkpoints)."""
    async def where(rt):
        return await rt.run_state(threading.get_ident), threading.get_ident(), rt.inline()

    ran, loop, inline = run_on_loop(100, 1 << 18, where, every)
    assert (ran == loop, inline) == (on_loop, on_loop)


def test_the_state_worker_hands_back_the_calls_result_and_its_exception():
    async def both(rt):
        value = await rt.run_state(lambda a, b: a + b, 2, 3)
        with pytest.raises(ValueError, match="refused here"):
            await rt.run_state(lambda: (_ for _ in ()).throw(ValueError("refused here")))
        return value

    assert run_on_loop(100_000, INLINE_STATE_ELEMENTS, both) == 5


def test_a_call_cancelled_before_the_state_worker_reaches_it_is_not_run():
    ran = []

    async def cancelled(rt):
        release = threading.Event()
        busy = rt.offload(release.wait)  # the worker is held; the next call queues behind it
        fut = rt.run_state(ran.append, "ran")
        fut.cancel()
        release.set()
        await busy
        await rt.run_state(lambda: None)  # (queued after the cancelled one: it has been reached by now)
        return fut.cancelled()

    assert run_on_loop(100_000, INLINE_STATE_ELEMENTS, cancelled) and ran == []


def test_an_offloaded_call_hands_back_its_result_and_exception_runs_on_the_worker_and_one_cancelled_is_not_run():
    ran = []

    async def offloaded(rt):
        value, thread = await rt.offload(lambda a: (a, threading.get_ident()), 7)
        with pytest.raises(ValueError, match="refused there"):
            await rt.offload(lambda: (_ for _ in ()).throw(ValueError("refused there")))
        release = threading.Event()
        busy = rt.offload(release.wait)
        queued = rt.offload(ran.append, "ran")
        counted = rt._offloaded
        queued.cancel()
        release.set()
        await busy
        await rt.offload(lambda: None)  # (queued after the cancelled one: it has been reached by now)
        return value, thread != threading.get_ident(), counted, rt._offloaded, rt.inline()

    # while two calls are offloaded nothing runs inline; once they are done (or cancelled) the count is back at 0
    assert run_on_loop(100, INLINE_STATE_ELEMENTS, offloaded) == (7, True, 2, 0, True) and ran == []


# ------------------------------------------------------------------------------ the request stream's timer
class FakeLoop:
    def __init__(self):
        self.now, self.timers = 0.0, []

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback):
        self.timers.append(when)
        return SimpleNamespace(cancel=lambda: None)


class FakeTask:
    def __init__(self, loop: FakeLoop):
        self.loop, self.cancelled = loop, False

    def get_loop(self):
        return self.loop

    def cancel(self):
        self.cancelled = True


def reader_reading(since: float, idle: float = 1.0, deadline: float = 100.0):
    reader = _StreamReader(SimpleNamespace(__aiter__=lambda: None), idle, deadline)
    loop = FakeLoop()
    reader._task, reader._since = FakeTask(loop), since
    return reader, loop


def test_the_timer_firing_before_the_read_now_waiting_is_due_moves_to_its_due_time_and_cuts_nothing():
    reader, loop = reader_reading(since=0.5)  # armed for an earlier read; this one began at 0.5
    loop.now = 1.0
    reader._check()
    assert not reader._task.cancelled and loop.timers == [1.5]


def test_the_timer_cuts_a_read_that_waited_the_idle_time_or_reached_the_calls_deadline():
    reader, loop = reader_reading(since=0.5)
    loop.now = 1.5
    reader._check()
    assert reader._task.cancelled and reader._fired and loop.timers == []
    reader, loop = reader_reading(since=0.5, deadline=0.8)
    loop.now = 0.8
    reader._check()
    assert reader._task.cancelled


def test_the_timer_firing_between_reads_cuts_nothing_and_is_armed_again_by_the_next_read():
    reader, loop = reader_reading(since=0.0)
    reader._task = None
    loop.now = 5.0
    reader._check()
    assert loop.timers == [] and reader._timer is None


class Chunks:
    """An async request stream: ``items`` then its end, or a wait that never ends (``stall``)."""

    def __init__(self, items, stall=False):
        self.items, self.stall = list(items), stall

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.stall:
            await asyncio.Event().wait()
        raise StopAsyncIteration


def test_a_stream_read_to_its_end_leaves_no_timer_armed_and_a_handler_that_stops_early_cancels_it_on_ending():
    async def to_the_end():
        reader = _StreamReader(Chunks(["a", "b"]), 60.0, asyncio.get_running_loop().time() + 600)
        got = [await reader.next(), await reader.next(), await reader.next()]
        return got, reader._timer

    assert asyncio.run(to_the_end()) == (["a", "b", None], None)

    async def stops_early():
        reader = _StreamReader(Chunks(["a", "b"]), 60.0, asyncio.get_running_loop().time() + 600)
        ended = asyncio.get_running_loop().create_future()

        async def handler():
            await reader.next()  # refuses what it read, say, and returns without reading on
            # (called when the task ends, after the reader's own callback: what that left)
            asyncio.current_task().add_done_callback(lambda _t: ended.set_result(reader._timer))
            assert reader._timer is not None
        await asyncio.get_running_loop().create_task(handler())
        return await ended

    assert asyncio.run(stops_early()) is None


def test_a_stalled_stream_is_ended_with_the_idle_refusal():
    async def stalled():
        reader = _StreamReader(Chunks(["a"], stall=True), 0.2, asyncio.get_running_loop().time() + 600)
        await reader.next()
        await reader.next()

    with pytest.raises(StreamTimeout, match=r"no chunk arrived for 0\.2 s: .*--stream-idle-timeout"):
        asyncio.run(stalled())
