"""psserver.serving.reply_holds without a network: a reply handing out R waits (a future on the loop) until the hold is
released, from the loop or another thread; one below R never waits; a hold outlasting its bound lets the reply
go, counted."""

import asyncio
import threading
from collections import Counter

from psserver.serving.reply_holds import ReplyHolds


class Part:
    """What a held reply reads of a partition: its version, label, counters."""

    def __init__(self, version=12):
        self.version, self.shard_id, self.partition, self.label = version, 0, 0, "shard 0"
        self.counters = Counter()

    def count(self, name, n=1):
        self.counters[name] += n


def run(body):
    async def main():
        loop = asyncio.get_running_loop()
        return await body(ReplyHolds(loop, threading.get_ident()), loop)
    return asyncio.run(main())


def test_a_reply_handing_out_r_waits_until_the_release_and_is_counted_once():
    part = Part()

    async def body(holds, loop):
        holds.hold(part, 12, timeout=60.0)
        waiting = asyncio.ensure_future(holds.wait(part, 12, loop.time() + 60.0))
        for _ in range(5):
            await asyncio.sleep(0)  # let it start waiting (turns of the loop, not time)
        assert not waiting.done()
        holds.release(part)
        await waiting
        return holds.held(part, 12)

    assert run(body) is None
    assert part.counters == Counter(handoff_replies_held=1)


def test_a_release_from_another_thread_wakes_the_held_reply_on_the_loop():
    part = Part()

    async def body(holds, loop):
        holds.hold(part, 12, timeout=60.0)
        waiting = asyncio.ensure_future(holds.wait(part, 13, loop.time() + 60.0))
        await asyncio.sleep(0)
        releaser = threading.Thread(target=holds.release, args=(part,))
        releaser.start()
        await waiting
        releaser.join()
        return waiting.done()

    assert run(body) is True
    assert part.counters["handoff_reply_holds_expired"] == 0


def test_a_reply_below_r_or_after_the_release_never_waits():
    part = Part(version=11)

    async def body(holds, loop):
        holds.hold(part, 12, timeout=60.0)
        below = holds.held(part, 11)
        await holds.wait(part, 11, loop.time() + 60.0)  # returns at once
        holds.release(part)
        await holds.wait(part, 12, loop.time() + 60.0)
        return below, holds.held(part, 12)

    assert run(body) == (None, None)
    assert part.counters["handoff_replies_held"] == 0


def test_a_hold_past_its_bound_lets_the_reply_go_in_the_old_layout_counted():
    part = Part()

    async def body(holds, loop):
        holds.hold(part, 12, timeout=0.0)  # the hand-off timeout: spent at once
        await holds.wait(part, 12, loop.time() + 60.0)
        holds.hold(part, 12, timeout=60.0)
        await holds.wait(part, 12, loop.time())  # the call's deadline: spent at once
        return holds.held(part, 12)

    assert run(body) == 12  # still held for the next reply: only DECIDE releases
    assert part.counters == Counter(handoff_replies_held=2, handoff_reply_holds_expired=2)
