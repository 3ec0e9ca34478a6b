"""Runtime.offload counts a call in flight until its ``fn`` returned on the state worker, not until its caller
stopped waiting (docs/design/attacks-2026-11-25.md, review follow-up)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from psserver.serving.runtime import Runtime


def test_a_cancelled_offloaded_call_still_running_on_the_worker_keeps_inline_work_off_the_loop():
    """RowCalls.run awaits runtime.offload(...) directly: a client's cancel cancels that future.  Before, its done
    callback dropped Runtime._offloaded at once -- while the worker was still inside fn (holding the shard's lock,
    changing the table) -- and the next small row call ran on the loop beside it.  Now inline() stays False until
    fn returns, and is True again once it has."""
    started, release = threading.Event(), threading.Event()

    def long_push():
        started.set()
        release.wait(30)

    async def main():
        loop = asyncio.get_running_loop()
        host = SimpleNamespace(shard_id=0, parts=[SimpleNamespace(slice_length=lambda: 100, version=0,
                                                                 checkpoints=SimpleNamespace(due=lambda v: False))])
        rt = Runtime(host, SimpleNamespace(loop=loop, loop_thread=threading.get_ident()), receive_buffers=1)
        try:
            fut = rt.offload(long_push)
            await loop.run_in_executor(None, started.wait, 30)
            assert not rt.inline()  # the worker is busy: inline work would wait for its lock
            fut.cancel()  # the handler awaiting it was cancelled (its client went away)
            await asyncio.sleep(0)  # (the cancelled future's callbacks run)
            still_running = not release.is_set()
            inline_while_running = rt.inline()
            release.set()
            await rt.offload(lambda: None)  # queued behind long_push: long_push has returned when this answers
            return still_running, inline_while_running, rt.inline(), rt._offloaded
        finally:
            rt.shutdown()

    still_running, inline_while_running, inline_after, count_after = asyncio.run(main())
    assert still_running
    assert not inline_while_running, "inline() is True while the offloaded call still runs on the state worker"
    assert inline_after and count_after == 0, "the count did not come back once the worker returned"
