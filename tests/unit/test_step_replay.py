"""A Step part received whole is replayed to its RPC's reader (psserver.service_step._replay), which copies each chunk on
the event loop: the replay hands the loop back every REPLAY_SLICE_BYTES, so a big part does not hold heartbeats
and health checks for its whole copy (0.7-1.3 s for 10**6 rows of dim 64, docs/limits.md).  Counted in loop
turns another task gets, not in time."""

from __future__ import annotations

import asyncio

import pytest

from psserver import service_step as service
from psserver.protocol.fastwire import RawChunk
from psserver.protocol.proto import ps_pb2 as pb

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
        async for _ in service._replay(chunks):
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
