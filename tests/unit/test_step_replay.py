"""A Step part received whole is replayed to its RPC's reader (psserver.serving.service_step._Received), which copies each chunk on
the event loop: the replay hands the loop back every REPLAY_SLICE_BYTES, so a big part does not hold heartbeats
and health checks for its whole copy (0.7-1.3 s for 10**6 rows of dim 64, docs/limits.md).  Counted in loop
turns another task gets, not in time."""

from __future__ import annotations

import asyncio

import pytest

from psserver.protocol.fastwire import RawChunk
from psserver.protocol.proto import ps_pb2 as pb
from psserver.serving import service_step as service

MIB = 1 << 20


def _turns_taken_by_others(chunks) -> int:
    async def run() -> int:
        turns, done = 0, False

        async def other():
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(other())
        await asyncio.sleep(0)  # the other task starts
        started = turns
        reader = service._Received(chunks, asyncio.get_running_loop().time() + 60)
        while await reader.next() is not None:
            pass
        done = True
        await ticker
        return turns - started

    return asyncio.run(run())


@pytest.mark.parametrize("make", [
    lambda: RawChunk(data=b"\0" * MIB),
    lambda: pb.RowsChunk(ids=b"\0" * (MIB // 4), rows=b"\0" * (3 * MIB // 4)),
], ids=["dense", "rows"])
def test_a_replayed_part_hands_the_loop_back_once_every_slice_of_its_bytes(make):
    chunks = [make() for _ in range(3 * service.REPLAY_SLICE_BYTES // MIB)]
    assert _turns_taken_by_others(chunks) >= 2


def test_a_small_part_is_replayed_without_handing_the_loop_back():
    assert _turns_taken_by_others([RawChunk(data=b"\0" * 4096)] * 4) == 0


def test_a_replayed_part_read_past_the_calls_deadline_is_refused_as_a_stream_past_it_is():
    from psserver.protocol.errors import StreamTimeout

    async def run():
        reader = service._Received([RawChunk(data=b"\0" * 8)] * 2, asyncio.get_running_loop().time() - 1)
        with pytest.raises(StreamTimeout, match="--max-call-seconds"):
            await reader.next()

    asyncio.run(run())


def test_a_replayed_part_starts_at_the_chunk_asked_and_ends_with_none():
    chunks = [RawChunk(data=bytes([i])) for i in range(3)]

    async def run():
        reader = service._Received(chunks, asyncio.get_running_loop().time() + 60, start=1)
        return [await reader.next() for _ in range(3)]

    assert asyncio.run(run()) == [chunks[1], chunks[2], None]
