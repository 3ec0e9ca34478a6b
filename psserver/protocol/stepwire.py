"""StepChunk messages (the Step RPC) without copying a dense part's tensor bytes.

A StepChunk is a part number and either a dense ``Chunk`` or a ``RowsChunk`` (ps.proto).  The dense chunk is
written and read with psserver.protocol.fastwire (its data stays a view until the reader copies it); the rows
chunk goes through the generated class (a few KB of rows a table and step).  The bytes are protobuf's, so a
peer built from the generated ``StepChunk`` reads them (tests/unit/test_stepwire.py checks both ways).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from psserver.protocol.fastwire import (
    MAX_CHUNK_FIELDS,
    _read_bytes,
    _read_varint,
    _varint,
    parse_chunk,
    parse_rows_chunk,
    serialize_chunk,
)

_TAG_PART, _TAG_DENSE, _TAG_ROWS, _TAG_MORE, _TAG_ONE_REPLY = 0x08, 0x12, 0x1A, 0x22, 0x28


@dataclass
class StepMessage:
    """One StepChunk: ``part``, and ``dense`` (a RawChunk or generated Chunk) or ``rows`` (a RowsChunk).
    ``more``: the chunks after it in the same message (a small step in one message; one level only).
    ``one_reply``: (a request's first message) the caller asks for the reply in one message (ps.proto).
    ``malformed``: why the received bytes could not be read (parse_step never raises); ``nbytes``: their size;
    ``wire``: the size of its chunk's field on the wire (parsed messages), which a dense chunk's view keeps alive
    with the rest of the message (StepParts bounds it by the part's declared size)."""

    part: int = 0
    dense: object | None = None
    rows: object | None = None  # a RawRowsChunk (parsed) or a generated RowsChunk
    malformed: str = ""
    nbytes: int = 0
    more: list = field(default_factory=list)
    one_reply: bool = False
    wire: int = 0

    def flat(self) -> list:
        """This chunk, then the ones it carries, in order."""
        return [self, *self.more]


def serialize_step(msg: StepMessage | bytes) -> bytes:
    """A StepMessage as protobuf wire bytes (one copy of a dense chunk's data); bytes already serialized (a
    packed reply: pack_serialized) go out as they are."""
    if isinstance(msg, bytes):
        return msg
    if msg.dense is not None:
        tag, body = _TAG_DENSE, serialize_chunk(msg.dense)
    elif msg.rows is not None:
        tag, body = _TAG_ROWS, msg.rows.SerializeToString()
    else:
        tag, body = None, b""
    head = [bytes((_TAG_PART,)), _varint(msg.part)] if msg.part else []
    if tag is not None:
        head += [bytes((tag,)), _varint(len(body))]
    if msg.one_reply:
        head.insert(0, bytes((_TAG_ONE_REPLY, 1)))
    parts = [*head, body]
    for m in msg.more:
        inner = serialize_step(m)
        parts += [bytes((_TAG_MORE,)), _varint(len(inner)), inner]
    return b"".join(parts)


def one_message(msgs: list[StepMessage], one_reply: bool = False) -> StepMessage:
    """``msgs`` as one message: the first, carrying the rest in ``more``."""
    return StepMessage(msgs[0].part, msgs[0].dense, msgs[0].rows, more=list(msgs[1:]), one_reply=one_reply)


def pack_serialized(messages: list[bytes]) -> bytes:
    """Serialized StepChunks (no ``more`` of their own) as one: the first, the rest appended as its ``more``
    fields -- the bytes serialize_step(one_message(...)) gives, built from messages serialized when they were
    written (a dense reply's chunks are views of a snapshot that is released after its last write)."""
    out = [messages[0]]
    for m in messages[1:]:
        out += [bytes((_TAG_MORE,)), _varint(len(m)), m]
    return b"".join(out)


def parse_step(message: bytes, nested: bool = False, max_more: int | None = None) -> StepMessage:
    """Protobuf wire bytes of a StepChunk -> StepMessage (a dense chunk's data a view into ``message``); the
    chunks of its ``more`` parsed too, which may carry no ``more`` of their own (``nested``).

    ``max_more`` (a shard's requests: limits.MAX_STEP_MESSAGE_CHUNKS): the most chunks ``more`` may carry.  This
    runs on the shard's event loop before any check of the caller, a Python object an entry: a 16 MiB message of
    empty two-byte entries was 8M objects and seconds of loop time.  Every other field counts against
    MAX_CHUNK_FIELDS, as in a Chunk."""
    buf = memoryview(message)
    msg = StepMessage(nbytes=len(buf))
    pos = fields = 0
    try:
        while pos < len(buf):
            key, pos = _read_varint(buf, pos)
            field, wire_type = key >> 3, key & 7
            if field != 4:
                fields += 1
                if fields > MAX_CHUNK_FIELDS:
                    raise ValueError(f"it carries more than {MAX_CHUNK_FIELDS} fields besides `more` in "
                                     f"{len(buf)} bytes")
            elif max_more is not None and len(msg.more) >= max_more:
                raise ValueError(f"`more` carries more than {max_more} chunks in {len(buf)} bytes, over the limit "
                                 f"of {max_more} chunks in one message")
            if field == 1 and wire_type == 0:
                msg.part, pos = _read_varint(buf, pos)
            elif field == 4 and wire_type == 2:
                if nested:
                    raise ValueError("a chunk in `more` carries `more` of its own")
                body, pos = _read_bytes(buf, pos, field)
                inner = parse_step(body, nested=True)
                if inner.malformed:
                    raise ValueError(inner.malformed)
                msg.more.append(inner)
            elif field == 5 and wire_type == 0:
                flag, pos = _read_varint(buf, pos)
                if nested and flag:
                    raise ValueError("a chunk in `more` sets one_reply: only the message itself may")
                msg.one_reply = bool(flag)
            elif field in (2, 3) and wire_type == 2:
                if msg.dense is not None or msg.rows is not None:  # (protobuf: the last wins; its bytes stay)
                    raise ValueError(f"it carries a second chunk (field {field}, after field "
                                     f"{2 if msg.dense is not None else 3}) but a StepChunk carries one")
                body, pos = _read_bytes(buf, pos, field)
                msg.wire = len(body)
                if field == 2:
                    msg.dense, msg.rows = parse_chunk(body), None
                    if msg.dense.malformed:
                        raise ValueError(msg.dense.malformed)
                else:
                    msg.rows, msg.dense = parse_rows_chunk(body), None
            else:
                raise ValueError(f"field {field} with wire type {wire_type} is not a StepChunk field")
    except Exception as e:  # noqa: BLE001 -- the client's malformed bytes: refused INVALID_ARGUMENT, not INTERNAL
        msg.malformed = f"malformed StepChunk message: {e}"
    return msg
