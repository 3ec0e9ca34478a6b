"""psserver.serving.digest_gate without a network: passes run one at a time per partition, callers who ask while one
runs share the next one (never the one running: it may predate their call)."""

import asyncio
from collections import Counter

from psserver.serving.digest_gate import DigestGate


class FakePart:
    def __init__(self):
        self.counters, self.state = Counter(), "s0"

    def count(self, metric, n=1):
        self.counters[metric] += n

    def state_digest(self):
        return self.state


def test_callers_during_a_pass_share_the_next_pass_which_sees_the_state_after_they_asked():
    async def scenario():
        loop = asyncio.get_running_loop()
        passes = []

        def offload(fn):  # a pass the test finishes by hand, reading the state when it does
            fut = loop.create_future()
            passes.append((fut, fn))
            return fut

        part, gate = FakePart(), DigestGate(offload)
        first = asyncio.ensure_future(gate.digest(part))
        await asyncio.sleep(0)  # (lets the first pass start: the test's own scheduling, not a wait for time)
        await asyncio.sleep(0)
        assert len(passes) == 1
        part.state = "s1"  # changed after the first pass began: the later callers must see it
        later = [asyncio.ensure_future(gate.digest(part)) for _ in range(5)]
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(passes) == 1  # one at a time: the next waits for the running one
        fut, fn = passes[0]
        fut.set_result("s0")
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(passes) == 2
        fut, fn = passes[1]
        fut.set_result(fn())
        assert await first == "s0"
        assert [await t for t in later] == ["s1"] * 5
        assert (part.counters["state_digests"], part.counters["state_digests_shared"],
                part.counters["state_digest_calls"]) == (2, 4, 6)

    asyncio.run(scenario())
