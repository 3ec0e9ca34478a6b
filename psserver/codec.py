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

from psserver.errors import InvalidRequest, TooLarge
from psserver.fastwire import RawChunk
from psserver.job import WIRE_DTYPE_NAMES
from psserver.proto import ps_pb2 as _pb

DEFAULT_CHUNK_BYTES = 1 << 20
TORCH_DTYPES = {_pb.FLOAT32: torch.float32, _pb.FLOAT16: torch.float16, _pb.BFLOAT16: torch.bfloat16}
WIRE_OF_TORCH = {v: k for k, v in TORCH_DTYPES.items()}


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
    """Cut ``payload`` into RawChunks whose data are views into it (see psserver.fastwire); offsets count elements.

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


class ChunkReader:
    """Reads one stream: ``header`` first (so callers can refuse early), then ``read``."""

    def __init__(self, chunks: Iterable[_pb.Chunk]):
        self._it = iter(chunks)
        try:
            self._first = next(self._it)
        except StopIteration:
            raise InvalidRequest("the stream is empty: the first chunk must carry a header") from None
        _check_wellformed(self._first)
        if not self._first.HasField("header"):
            raise InvalidRequest("the first chunk has no header")
        self.header = self._first.header
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
        h = self.header
        if h.dtype != wire:
            raise InvalidRequest(f"dtype is {dtype_name(h.dtype)} but this job sends {dtype_name(wire)}")
        dtype = TORCH_DTYPES[wire]
        if h.length * dtype.itemsize > max_bytes:
            raise TooLarge(
                f"the stream declares {h.length * dtype.itemsize} bytes, over this shard's limit of {max_bytes} bytes"
            )
        if h.length != expected_length:
            raise InvalidRequest(f"length is {h.length} elements but this shard's slice has {expected_length}")
        direct = out is not None and dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"
        target = out if direct else torch.empty(expected_length, dtype=dtype)
        raw = target.view(torch.uint8).numpy()  # numpy: copies from read-only protobuf bytes without a warning
        pos = 0  # next element expected
        chunk = self._first
        while chunk is not None:
            _check_wellformed(chunk)
            if chunk is not self._first and chunk.HasField("header"):
                raise InvalidRequest(f"the chunk at offset {chunk.offset} repeats the header; only the first may")
            if chunk.offset != pos:
                raise InvalidRequest(
                    f"chunk offset is {chunk.offset} but {pos} was expected: chunks must tile [0, {expected_length}) "
                    "once, in order"
                )
            n_bytes = len(chunk.data)
            if n_bytes % dtype.itemsize:
                raise InvalidRequest(
                    f"the chunk at offset {chunk.offset} has {n_bytes} bytes, not a multiple of {dtype.itemsize} "
                    f"({dtype_name(wire)})"
                )
            n = n_bytes // dtype.itemsize
            if pos + n > expected_length:
                raise InvalidRequest(
                    f"the chunk at offset {chunk.offset} holds {n} elements, past the end of [0, {expected_length})"
                )
            if n:
                raw[pos * dtype.itemsize : (pos + n) * dtype.itemsize] = np.frombuffer(chunk.data, dtype=np.uint8)
            pos += n
            self.bytes_read += n_bytes
            chunk = next(self._it, None)
        if pos != expected_length:
            raise InvalidRequest(f"the chunks cover [0, {pos}) but the slice is [0, {expected_length})")
        if out is not None and not direct:
            out.copy_(target)  # converts to fp32 in the same pass: no fp32 temporary
            values = out
        else:
            values = target if dtype == torch.float32 else target.float()
        if require_finite:
            check_finite(values)
        return values


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
