"""`ps-loadgen stall`: a stranger holding silent Push streams open."""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections import Counter

import grpc
import grpc.aio

from psserver.protocol.fastwire import serialize_chunk
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.stubs import method
from trainer.tools.loadgen.board import Board
from trainer.tools.loadgen.config import CHANNEL_OPTIONS


async def _stall_streams(address: str, streams: int, connections: int, cells) -> dict:
    """Open ``streams`` Push streams that never send a message, hold them until released, then cancel them."""
    cells[Board.STRANGER_UP] = 1
    while not cells[Board.STALL_OPEN]:
        if cells[Board.ABORT]:
            return {}
        await asyncio.sleep(0.01)
    never = asyncio.Event()

    async def silent():
        await never.wait()  # never set: the stream stays open and empty
        yield b""

    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(connections)]
    pushes = [ch.stream_unary(method("Push"), serialize_chunk, _pb.PushReply.FromString) for ch in channels]
    calls = [pushes[i % connections](silent()) for i in range(streams)]

    async def hold(call) -> str:
        try:
            await call
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name
        except asyncio.CancelledError:
            return "CANCELLED"

    tasks = [asyncio.create_task(hold(c)) for c in calls]
    await asyncio.gather(*(asyncio.wait_for(c.wait_for_connection(), 10) for c in calls), return_exceptions=True)
    await asyncio.sleep(0.2)  # let immediate refusals arrive before counting what is open
    cells[Board.STALL_OPENED] = sum(not t.done() for t in tasks)
    while not (cells[Board.STALL_RELEASE] or cells[Board.ABORT]):
        await asyncio.sleep(0.01)
    ended_early = Counter(t.result() for t in tasks if t.done())
    still_open = sum(not t.done() for t in tasks)
    for c in calls:
        c.cancel()
    await asyncio.gather(*tasks)
    await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
    cells[Board.STALL_DONE] = 1
    return dict(streams=streams, connections=connections, open_at_release=still_open,
                ended_before_release=dict(ended_early))


def stranger_main(address: str, streams: int, connections: int, cells, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = asyncio.run(_stall_streams(address, streams, connections, cells))
    except BaseException:  # noqa: BLE001
        result = dict(crash=traceback.format_exc())
    cells[Board.STALL_DONE] = 1
    conn.send(result)
    conn.close()
