"""Chunk messages without the copies: protobuf wire format, hand-serialised on the hot path.

A ``Chunk`` carries up to a few MB of tensor bytes.  Going through the
generated protobuf classes copies those bytes three times to send (slice,
field assignment, serialisation) and three to receive (parse, field access,
copy out).  Here the same wire format is written and read directly:

* ``serialize_chunk`` joins the tag bytes, the small header and a memoryview of
  the tensor: one copy, into the message gRPC sends.
* ``parse_chunk`` reads the three fields of a received message and returns the
  data as a memoryview into it: no copy until the reader copies into its
  destination tensor.

The bytes on the wire are exactly protobuf's, so clients and servers built from
the generated code interoperate (tests/unit/test_fastwire.py checks both ways).
"""

from __future__ import annotations

from dataclasses import dataclass

from psserver.protocol.proto import ps_pb2 as _pb

_TAG_HEADER, _TAG_OFFSET, _TAG_DATA = 0x0A, 0x10, 0x1A
# Fields one Chunk message may carry: ours write three (header, offset, data).  Parsing runs on the shard's event
# loop before any check of the caller, a field at a time in Python: a 16 MiB message of two-byte fields (an offset,
# an unknown field, an empty header to merge -- each allowed by protobuf, repeated) was 8M turns of this loop, seconds
# of a stalled loop from anyone who reaches the port (docs/design/attacks-2026-11-25.md).
MAX_CHUNK_FIELDS = 16


@dataclass
class RawChunk:
    """Duck-types the generated ``Chunk`` for ChunkReader: header, offset, data, HasField."""

    header: _pb.ChunkHeader | None = None
    offset: int = 0
    data: bytes | memoryview = b""
    malformed: str = ""  # set by parse_chunk instead of raising: the reader refuses with INVALID_ARGUMENT

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's spelling)
        if name != "header":
            raise ValueError(f"RawChunk has no optional field {name!r}")
        return self.header is not None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _read_bytes(buf: memoryview, pos: int, field: int) -> tuple[memoryview, int]:
    """A length-delimited field's body at ``pos`` (a view, no copy) and the position after it."""
    size, pos = _read_varint(buf, pos)
    if pos + size > len(buf):
        raise ValueError(f"field {field} runs past the end of the message")
    return buf[pos : pos + size], pos + size


def serialize_chunk(chunk) -> bytes:
    """A RawChunk (or a generated Chunk) as protobuf wire bytes, with one copy of the data."""
    if not isinstance(chunk, RawChunk):
        return chunk.SerializeToString()
    return _serialize(chunk.header, chunk.offset, (_TAG_DATA, chunk.data))


def _serialize(header, offset: int, *fields: tuple[int, bytes | memoryview]) -> bytes:
    """A chunk message's wire bytes (Chunk and RowsChunk alike): its header (field 1) if any, its offset (field 2)
    if not 0, then each (tag, bytes) field that is not empty -- field order, as the generated classes write them,
    with one copy of each payload."""
    parts = []
    if header is not None:
        h = header.SerializeToString()
        parts += [bytes((_TAG_HEADER,)), _varint(len(h)), h]
    if offset:
        parts += [bytes((_TAG_OFFSET,)), _varint(offset)]
    for tag, body in fields:
        if len(body):
            parts += [bytes((tag,)), _varint(len(body)), body]
    return b"".join(parts)


def _fields(message, fields_of: str):
    """(field number, wire type, value) of each field of protobuf wire bytes: a varint's value, a length-delimited
    field's body as a view, None for fixed-size fields (skipped); at most MAX_CHUNK_FIELDS fields (``fields_of``
    says what the message should carry).  Raises ValueError for bytes that do not parse."""
    buf = memoryview(message)
    pos = count = 0
    while pos < len(buf):
        count += 1
        if count > MAX_CHUNK_FIELDS:
            raise ValueError(f"it carries more than {MAX_CHUNK_FIELDS} fields ({fields_of}) in {len(buf)} bytes")
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
        elif wire_type == 2:
            value, pos = _read_bytes(buf, pos, field)
        elif wire_type in (1, 5):
            value, pos = None, pos + (8 if wire_type == 1 else 4)
        else:
            raise ValueError(f"wire type {wire_type} of field {field} is not allowed here")
        if pos > len(buf):
            raise ValueError("the message is truncated")
        yield field, wire_type, value


def parse_chunk(message: bytes) -> RawChunk:
    """Protobuf wire bytes of a Chunk -> RawChunk whose data is a view into ``message``.  Never raises."""
    chunk = RawChunk()
    try:
        for field, wire_type, value in _fields(message, "a Chunk has 3: header, offset, data"):
            if field == 2 and wire_type == 0:
                chunk.offset = value
            elif field == 1 and wire_type == 2:
                header = chunk.header or _pb.ChunkHeader()
                header.MergeFromString(bytes(value))  # repeated sub-messages merge, as protobuf does
                chunk.header = header
            elif field == 3 and wire_type == 2:
                chunk.data = value
    except Exception as e:  # a malformed message becomes a clear refusal, not a gRPC INTERNAL error
        chunk.malformed = f"malformed Chunk message: {e}"
    return chunk


# -------------------------------------------------------------------------------------------- RowsChunk
_TAG_ROWS_IDS, _TAG_ROWS_ROWS = 0x1A, 0x22  # (header and offset: a Chunk's tags, fields 1 and 2)


@dataclass(eq=False)
class RawRowsChunk:
    """Duck-types the generated ``RowsChunk`` (header, offset, ids, rows, HasField, SerializeToString) with its
    ids and rows as views into the received message: a step's table part is read without the two copies of its
    rows that ``RowsChunk.FromString(bytes(body))`` made (and written, ``SerializeToString``, with one)."""

    header: _pb.RowsHeader | None = None
    offset: int = 0
    ids: bytes | memoryview = b""
    rows: bytes | memoryview = b""

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's spelling)
        if name != "header":
            raise ValueError(f"RawRowsChunk has no optional field {name!r}")
        return self.header is not None

    def __eq__(self, other) -> bool:
        """Equal to a RawRowsChunk or a generated RowsChunk of the same fields, as protobuf's messages compare."""
        if not isinstance(other, (RawRowsChunk, _pb.RowsChunk)):
            return NotImplemented
        head = other.header if other.HasField("header") else None
        return (self.header, self.offset, bytes(self.ids), bytes(self.rows)) == (head, other.offset, bytes(other.ids),
                                                                                 bytes(other.rows))

    __hash__ = None

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's spelling): the bytes the generated class writes
        return _serialize(self.header, self.offset, (_TAG_ROWS_IDS, self.ids), (_TAG_ROWS_ROWS, self.rows))


def parse_rows_chunk(message) -> RawRowsChunk:
    """Protobuf wire bytes of a RowsChunk -> RawRowsChunk whose ids and rows are views into ``message``; protobuf's
    rules (a repeated header merges, a repeated bytes field's last wins, unknown fields are skipped), at most
    MAX_CHUNK_FIELDS fields.  Raises ValueError for bytes that do not parse."""
    chunk = RawRowsChunk()
    for field, wire_type, value in _fields(message, "a RowsChunk has 4: header, offset, ids, rows"):
        if field == 2 and wire_type == 0:
            chunk.offset = value
        elif field == 1 and wire_type == 2:
            header = chunk.header or _pb.RowsHeader()
            header.MergeFromString(bytes(value))
            chunk.header = header
        elif field == 3 and wire_type == 2:
            chunk.ids = value
        elif field == 4 and wire_type == 2:
            chunk.rows = value
    return chunk


def serialize_rows_chunk(chunk) -> bytes:
    """A RawRowsChunk or a generated RowsChunk as wire bytes: the row RPCs' serializer on both sides."""
    return chunk.SerializeToString()
