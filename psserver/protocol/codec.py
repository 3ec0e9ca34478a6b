"""Tensors to and from streams of Chunk messages.

A 1-D tensor travels as raw little-endian bytes cut into chunks of at most
``chunk_bytes`` (no message near gRPC's size limits, bounded memory per
message).  The first chunk carries the header.  The reader checks everything
before the caller touches any state: a header on the first chunk only, the
dtype, the declared length, chunks tiling [0, length) exactly once and in
order, and (on request) that every value is finite.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import numpy as np
import torch

from psserver.protocol.errors import InvalidRequest, TooLarge
from psserver.protocol.fastwire import RawChunk
from psserver.protocol.job import WIRE_DTYPE_NAMES
from psserver.protocol.proto import ps_pb2 as _pb

DEFAULT_CHUNK_BYTES = 1 << 20
TORCH_DTYPES = {_pb.FLOAT32: torch.float32, _pb.FLOAT16: torch.float16, _pb.BFLOAT16: torch.bfloat16}


def dtype_name(wire: int) -> str:
    return WIRE_DTYPE_NAMES.get(wire, f"unknown dtype #{wire}")


def wire_tensor(tensor: torch.Tensor, wire: int) -> torch.Tensor:
    """The tensor as a flat, contiguous CPU tensor of the wire dtype -- no copy when it already is one."""
    t = tensor.detach().reshape(-1)
    if t.dtype != TORCH_DTYPES[wire]:
        t = t.to(TORCH_DTYPES[wire])
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def encode(payload: bytes | torch.Tensor, header: _pb.ChunkHeader,
           chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[_pb.Chunk]:
    """Cut ``payload`` (wire-dtype bytes, or a ``wire_tensor``) into generated ``Chunk`` messages.

    For tools and tests that use the generated stubs; the hot path uses ``encode_raw``.
    """
    for raw in encode_raw(payload, header, chunk_bytes):
        chunk = _pb.Chunk(offset=raw.offset, data=bytes(raw.data))
        if raw.header is not None:
            chunk.header.CopyFrom(raw.header)
        yield chunk


def encode_raw(payload: bytes | torch.Tensor, header: _pb.ChunkHeader,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[RawChunk]:
    """Cut ``payload`` into RawChunks whose data are views into it (see psserver.protocol.fastwire); offsets count elements.

    A tensor is read in place, chunk by chunk, as gRPC sends: the caller keeps
    it unchanged until the call returns.
    """
    itemsize = TORCH_DTYPES[header.dtype].itemsize
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    view = _raw(payload) if isinstance(payload, torch.Tensor) else memoryview(payload)
    if not len(view):
        yield RawChunk(header=header, offset=0, data=b"")
        return
    for pos in range(0, len(view), step):
        yield RawChunk(header=header if pos == 0 else None, offset=pos // itemsize, data=view[pos : pos + step])


def check_stream_header(h: _pb.ChunkHeader, expected_length: int, wire: int, max_bytes: int) -> None:
    """Refuse a stream on its header's dtype and declared size, before anything is allocated for it."""
    if h.dtype != wire:
        raise InvalidRequest(f"dtype is {dtype_name(h.dtype)} but this job sends {dtype_name(wire)}")
    if h.topk:
        check_topk_header(h, expected_length, wire, max_bytes)
        return
    declared = h.length * TORCH_DTYPES[wire].itemsize
    if declared > max_bytes:
        raise TooLarge(f"the stream declares {declared} bytes, over this shard's limit of {max_bytes} bytes")
    if h.length != expected_length:
        raise InvalidRequest(f"length is {h.length} elements but this shard's slice has {expected_length}")


class ChunkAssembler:
    """Checks one stream's chunks and copies them into a tensor as they arrive.

    Used by the blocking ``ChunkReader`` (clients) and by the async server, which
    feeds chunks as its event loop receives them.  Bounds come first: the
    declared size against ``max_bytes`` before anything is allocated, and with
    ``min_chunk_bytes`` every chunk but the last must carry at least that many
    bytes, so a stream cut into tiny or empty pieces is refused at once instead
    of burning the receiver's CPU.
    """

    def __init__(self, header: _pb.ChunkHeader, expected_length: int, wire: int, max_bytes: int,
                 out: torch.Tensor | None = None, min_chunk_bytes: int = 0):
        if header.topk:
            raise InvalidRequest(f"topk is {header.topk} but this stream carries dense values (topk 0): only a "
                                 "Push or PushPull may be sparse")
        check_stream_header(header, expected_length, wire, max_bytes)
        self.dtype = dtype = TORCH_DTYPES[wire]
        self.length, self.wire, self.min_chunk_bytes = expected_length, wire, min_chunk_bytes
        self.out = out
        self.direct = out is not None and dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"
        self.target = out if self.direct else torch.empty(expected_length, dtype=dtype)
        self._raw = self.target.view(torch.uint8).numpy()  # numpy: copies from read-only bytes without a warning
        self.pos = 0  # next element expected
        self.chunks = 0
        self.bytes_read = 0

    def add(self, chunk) -> None:
        _check_wellformed(chunk)
        if self.chunks and chunk.HasField("header"):
            raise InvalidRequest(f"the chunk at offset {chunk.offset} repeats the header; only the first may")
        if self.chunks and self.pos == self.length:
            raise InvalidRequest(f"a chunk at offset {chunk.offset} arrived after the stream covered [0, {self.length})")
        if chunk.offset != self.pos:
            raise InvalidRequest(
                f"chunk offset is {chunk.offset} but {self.pos} was expected: chunks must tile [0, {self.length}) "
                "once, in order"
            )
        itemsize = self.dtype.itemsize
        n_bytes = len(chunk.data)
        if n_bytes % itemsize:
            raise InvalidRequest(
                f"the chunk at offset {chunk.offset} has {n_bytes} bytes, not a multiple of {itemsize} "
                f"({dtype_name(self.wire)})"
            )
        n = n_bytes // itemsize
        if self.pos + n > self.length:
            raise InvalidRequest(
                f"the chunk at offset {chunk.offset} holds {n} elements, past the end of [0, {self.length})"
            )
        if n_bytes < self.min_chunk_bytes and self.pos + n != self.length:
            raise InvalidRequest(
                f"the chunk at offset {chunk.offset} carries {n_bytes} bytes, under the minimum of "
                f"{self.min_chunk_bytes} for every chunk but the last"
            )
        if n:
            self._raw[self.pos * itemsize : (self.pos + n) * itemsize] = np.frombuffer(chunk.data, dtype=np.uint8)
        self.pos += n
        self.chunks += 1
        self.bytes_read += n_bytes

    def finish(self, require_finite: bool = True) -> torch.Tensor:
        """The assembled fp32 tensor, once the chunks covered the whole stream."""
        if self.pos != self.length:
            raise InvalidRequest(f"the chunks cover [0, {self.pos}) but the slice is [0, {self.length})")
        if self.out is not None and not self.direct:
            self.out.copy_(self.target)  # converts to fp32 in the same pass: no fp32 temporary
            values = self.out
        else:
            values = self.target if self.dtype == torch.float32 else self.target.float()
        if require_finite:
            check_finite(values)
        return values


class ChunkReader:
    """Reads one stream: ``header`` first (so callers can refuse early), then ``read``."""

    def __init__(self, chunks: Iterable[_pb.Chunk]):
        self._it = iter(chunks)
        try:
            self._first = next(self._it)
        except StopIteration:
            raise InvalidRequest("the stream is empty: the first chunk must carry a header") from None
        self.header = first_header(self._first)
        self.bytes_read = 0

    def read(self, expected_length: int, wire: int, max_bytes: int, require_finite: bool = True,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Assemble the stream into an fp32 tensor of ``expected_length`` elements.

        With ``out`` (a contiguous fp32 CPU tensor of that length) and an fp32
        stream, the chunks are copied straight into it: no other buffer.  On a
        refusal ``out`` may hold part of the stream, so pass scratch memory.

        Raises:
            InvalidRequest: wrong dtype or length, bad tiling, non-finite values.
            TooLarge: the declared stream is bigger than ``max_bytes``.
        """
        asm = ChunkAssembler(self.header, expected_length, wire, max_bytes, out)
        chunk = self._first
        while chunk is not None:
            asm.add(chunk)
            chunk = next(self._it, None)
        self.bytes_read = asm.bytes_read
        return asm.finish(require_finite)


def first_header(chunk) -> _pb.ChunkHeader:
    """The header of a stream's first chunk; refuses a malformed chunk or one without a header."""
    _check_wellformed(chunk)
    if not chunk.HasField("header"):
        raise InvalidRequest("the first chunk has no header")
    return chunk.header


def _check_wellformed(chunk) -> None:
    problem = getattr(chunk, "malformed", "")
    if problem:
        raise InvalidRequest(problem)


def check_finite(values: torch.Tensor) -> None:
    """Refuse NaN/Inf.  Fast path: a finite sum means every value is finite (NaN and Inf propagate);
    a sum that overflows to Inf although every value is finite falls through to the exact check."""
    if values.numel() == 0 or math.isfinite(float(values.sum())):
        return
    finite = torch.isfinite(values)
    if not bool(finite.all()):  # else: finite values whose fp32 sum overflowed
        bad = (~finite).nonzero()
        raise InvalidRequest(
            f"{bad.numel()} values are NaN or infinite (first at element {int(bad[0])}: {float(values[bad[0]])})"
        )


# ---------------------------------------------------------------------- top-k pushes
# A top-k push (ChunkHeader.topk = k > 0) carries k (index, value) pairs of a slice: k indices, strictly
# increasing, then k values in the wire dtype, as one payload of raw little-endian bytes cut into chunks whose
# offsets count bytes.  The receiver bounds everything before it writes a value anywhere, then scatters the
# pairs into a zeroed slice-sized tensor, so the rest of the push path sees a dense gradient.

INT32_INDEX_LIMIT = 1 << 31  # slices up to this many elements send int32 indices; longer ones int64


def index_dtype(length: int) -> torch.dtype:
    """The indices' dtype for a slice of ``length`` elements (both sides derive it; nothing on the wire says)."""
    return torch.int32 if length <= INT32_INDEX_LIMIT else torch.int64


def topk_payload_bytes(k: int, length: int, wire: int) -> int:
    return k * (index_dtype(length).itemsize + TORCH_DTYPES[wire].itemsize)


def check_topk_header(h: _pb.ChunkHeader, expected_length: int, wire: int, max_bytes: int) -> None:
    """Refuse a top-k push on its header: slice length, k against it, and the payload's size."""
    if h.length != expected_length:
        raise InvalidRequest(f"length is {h.length} elements but this shard's slice has {expected_length}")
    if h.topk > expected_length:
        raise InvalidRequest(f"topk is {h.topk} pairs but this shard's slice has only {expected_length} elements")
    declared = topk_payload_bytes(h.topk, expected_length, wire)
    if declared > max_bytes:
        raise TooLarge(f"the stream declares {declared} bytes, over this shard's limit of {max_bytes} bytes")


def encode_topk_raw(indices: torch.Tensor, values: torch.Tensor, header: _pb.ChunkHeader,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[RawChunk]:
    """The chunks of a top-k push: ``indices`` (of ``index_dtype(header.length)``) then ``values`` (of the
    header's dtype), ``header.topk`` of each.  One copy of the pairs into the payload; the chunks view it."""
    k = header.topk
    if indices.numel() != k or values.numel() != k or k == 0:
        raise ValueError(f"a top-k push of k={k} needs k >= 1 indices and values, got {indices.numel()} and "
                         f"{values.numel()}")
    if indices.dtype != index_dtype(header.length) or values.dtype != TORCH_DTYPES[header.dtype]:
        raise ValueError(f"top-k pairs are {indices.dtype} / {values.dtype}, not "
                         f"{index_dtype(header.length)} / {TORCH_DTYPES[header.dtype]}")
    payload = torch.cat([indices.contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])
    view = _raw(payload)
    step = max(1, chunk_bytes)
    return [RawChunk(header=header if pos == 0 else None, offset=pos, data=view[pos : pos + step])
            for pos in range(0, len(view), step)]


class TopKAssembler:
    """Checks a top-k push's chunks as they arrive, then bounds its pairs and scatters them (``finish``).

    Same rules as ``ChunkAssembler`` for the stream (header on the first chunk only, chunks tiling the
    payload once and in order, ``min_chunk_bytes``); then every index in range and strictly increasing.
    Nothing is written to ``out`` before every check has passed.
    """

    def __init__(self, header: _pb.ChunkHeader, expected_length: int, wire: int, max_bytes: int,
                 out: torch.Tensor | None = None, min_chunk_bytes: int = 0):
        check_topk_header(header, expected_length, wire, max_bytes)
        self.k, self.length, self.wire, self.min_chunk_bytes = header.topk, expected_length, wire, min_chunk_bytes
        self.index_dtype, self.dtype = index_dtype(expected_length), TORCH_DTYPES[wire]
        self.size = topk_payload_bytes(self.k, expected_length, wire)
        self.payload = torch.empty(self.size, dtype=torch.uint8)
        self._raw = self.payload.numpy()
        self.out = out
        self.pos = 0  # next byte expected
        self.chunks = 0
        self.bytes_read = 0

    def add(self, chunk) -> None:
        _check_wellformed(chunk)
        if self.chunks and chunk.HasField("header"):
            raise InvalidRequest(f"the chunk at offset {chunk.offset} repeats the header; only the first may")
        if chunk.offset != self.pos:
            raise InvalidRequest(f"chunk offset is {chunk.offset} but byte {self.pos} was expected: chunks must tile "
                                 f"the top-k payload [0, {self.size}) bytes once, in order")
        n = len(chunk.data)
        if self.pos + n > self.size:
            raise InvalidRequest(f"the chunk at offset {chunk.offset} holds {n} bytes, past the end of the top-k "
                                 f"payload of {self.size} bytes (topk {self.k} pairs)")
        if n < self.min_chunk_bytes and self.pos + n != self.size:
            raise InvalidRequest(f"the chunk at offset {chunk.offset} carries {n} bytes, under the minimum of "
                                 f"{self.min_chunk_bytes} for every chunk but the last")
        if n:
            self._raw[self.pos : self.pos + n] = np.frombuffer(chunk.data, dtype=np.uint8)
        self.pos += n
        self.chunks += 1
        self.bytes_read += n

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices as int64, values as fp32), once the payload is complete and every index is bounded."""
        if self.pos != self.size:
            raise InvalidRequest(f"the chunks cover {self.pos} bytes but topk {self.k} pairs need {self.size}")
        split = self.k * self.index_dtype.itemsize
        indices = self.payload[:split].view(self.index_dtype).long()
        values = self.payload[split:].view(self.dtype).float()
        check_indices(indices, self.length)
        return indices, values

    def finish(self, require_finite: bool = True) -> torch.Tensor:
        """The slice as a dense fp32 tensor (``out`` if given): zeros but at the pairs' indices."""
        indices, values = self.pairs()
        if require_finite:
            check_finite(values)
        dense = self.out if self.out is not None else torch.empty(self.length, dtype=torch.float32)
        dense.zero_()
        dense[indices] = values
        return dense


def check_indices(indices: torch.Tensor, length: int) -> None:
    """Refuse indices outside [0, length) or not strictly increasing, naming the first bad position."""
    if not indices.numel():
        return
    if int(indices[0]) < 0:
        raise InvalidRequest(f"top-k index 0 is {int(indices[0])}, below 0")
    steps = indices[1:] - indices[:-1]
    bad = (steps <= 0).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise InvalidRequest(f"top-k indices must be strictly increasing: index {i + 1} is {int(indices[i + 1])} "
                             f"after {int(indices[i])}")
    if int(indices[-1]) >= length:  # increasing, so the last is the largest
        raise InvalidRequest(f"top-k index {indices.numel() - 1} is {int(indices[-1])}, out of this shard's slice "
                             f"[0, {length})")
