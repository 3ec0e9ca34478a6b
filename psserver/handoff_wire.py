"""A live re-shard's Handoff stream (source -> destination): one payload per stream, tiled over chunks.

A payload is a ``torch.save`` of a dict of tensors and plain values (a COPY's range and optimizer state, a
FORWARD's averaged gradient and lr, a VOTE's digest and timeline), read back with ``weights_only`` so a peer
can send data, never code.  Kept apart from psserver.handoff_io so the io layer reads as the machines' actions.
"""

from __future__ import annotations

import io
from typing import Iterable, Iterator

import torch

from psserver.protocol.errors import InvalidRequest
from psserver.protocol.proto import ps_pb2 as _pb

CHUNK_BYTES = 1 << 20  # under gRPC's default 4 MB message limit with room to spare
MAX_PAYLOAD_BYTES = 1 << 34  # a move is at most a slice: refuse a stream that claims more before reading it all


def pack(payload: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any undecodable payload is the caller's bad input
        raise InvalidRequest(f"a Handoff payload of {len(data)} bytes could not be decoded: {str(e)[:120]}") from None


def chunks(kind: int, plan: str, source: str, move: int, version: int, payload: dict) -> Iterator[_pb.HandoffChunk]:
    """The stream for one payload; the first chunk carries the header fields, every chunk a piece of the data."""
    data = pack(payload)
    for at in range(0, max(len(data), 1), CHUNK_BYTES):
        yield _pb.HandoffChunk(kind=kind, plan=plan, source=source, move=move, version=version,
                               data=data[at:at + CHUNK_BYTES])


class _Payload:
    """A Handoff stream's chunks gathered into one payload, bounded by MAX_PAYLOAD_BYTES as they arrive."""

    def __init__(self):
        self.first, self.parts, self.size = None, [], 0

    def add(self, chunk: _pb.HandoffChunk) -> None:
        self.first = self.first or chunk
        self.size += len(chunk.data)
        if self.size > MAX_PAYLOAD_BYTES:
            raise InvalidRequest(f"a Handoff payload is over {MAX_PAYLOAD_BYTES} bytes: refused")
        self.parts.append(chunk.data)

    def whole(self) -> tuple[_pb.HandoffChunk, bytes]:
        if self.first is None:
            raise InvalidRequest("a Handoff stream ended before its first chunk")
        return self.first, b"".join(self.parts)


def read(request_iterator: Iterable[_pb.HandoffChunk]) -> tuple[_pb.HandoffChunk, bytes]:
    """(the first chunk, the whole payload's bytes) of a stream read to its end."""
    payload = _Payload()
    for chunk in request_iterator:
        payload.add(chunk)
    return payload.whole()


async def read_async(request_iterator, check=lambda first: None) -> tuple[_pb.HandoffChunk, bytes]:
    """``read`` for the servicer's async stream; ``check(first)`` runs on the first chunk, before the rest is read."""
    payload = _Payload()
    async for chunk in request_iterator:
        if payload.first is None:
            check(chunk)
        payload.add(chunk)
    return payload.whole()
