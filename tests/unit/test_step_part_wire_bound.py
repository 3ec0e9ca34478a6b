"""A Step part's chunks are bounded by the bytes they take on the wire -- what they keep in memory -- against their
header's declared payload, not by their payload alone (docs/design/attacks-2026-11-25.md, review follow-up)."""

from __future__ import annotations

import pytest

from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest
from psserver.protocol.fastwire import RawChunk, _varint, serialize_chunk
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.serving.step_parts import StepParts

HEADER = dict(rank=0, trainer_id="t0", fingerprint="f" * 16)


def _dense_wire(inner: bytes) -> bytes:
    return bytes((0x12,)) + _varint(len(inner)) + inner  # StepChunk.dense


def _parts(*wires: bytes) -> StepParts:
    parts = StepParts(1 << 30, min_chunk_bytes=256)
    for w in wires:
        msg = parse_step(w, max_more=limits.MAX_STEP_MESSAGE_CHUNKS)
        assert not msg.malformed, msg.malformed
        parts.add(msg)
    return parts


def test_a_dense_part_declaring_4000_bytes_with_8_mib_in_an_unknown_field_is_invalid_argument_at_its_header():
    """Before: parse_chunk skipped the unknown field, the part's payload was 4,000 bytes, and its chunk's data -- a
    view into the whole received message -- kept 8 MiB alive until the stream ended (x parts x calls a rank)."""
    pad = b"\0" * (8 << 20)
    inner = serialize_chunk(RawChunk(header=pb.ChunkHeader(length=1000, **HEADER), data=b"\0" * 4000))
    inner += bytes(((15 << 3) | 2,)) + _varint(len(pad)) + pad  # field 15: not a Chunk field, skipped
    parts = _parts(_dense_wire(inner))
    with pytest.raises(InvalidRequest, match=f"part 0's chunks take {len(inner)} bytes on the wire so far but its "
                                             "header declares 4000 bytes of payload: at most"):
        parts.declare(parts.parts[0], 4000)


def test_a_later_dense_chunk_padded_past_its_framing_is_refused_as_it_arrives():
    first = serialize_chunk(RawChunk(header=pb.ChunkHeader(length=2000, **HEADER), data=b"\0" * 4000))
    parts = _parts(_dense_wire(first))
    parts.declare(parts.parts[0], 8000)
    padded = serialize_chunk(RawChunk(offset=1000, header=pb.ChunkHeader(trainer_id="x" * 9000), data=b"\0" * 4000))
    msg = parse_step(_dense_wire(padded))
    with pytest.raises(InvalidRequest, match="part 0's chunks take .* bytes on the wire so far but its header "
                                             "declares 8000 bytes of payload"):
        parts.add(msg)


def test_a_step_chunk_carrying_two_chunks_is_malformed():
    """The first chunk's bytes would stay in the message, counted nowhere (protobuf keeps the last)."""
    chunk = serialize_chunk(RawChunk(header=pb.ChunkHeader(**HEADER), data=b"\0" * 8))
    msg = parse_step(_dense_wire(chunk) + _dense_wire(chunk))
    assert "carries a second chunk (field 2, after field 2) but a StepChunk carries one" in msg.malformed


def test_parts_as_trainers_send_them_fit_their_allowance_pull_ids_and_all():
    dense = [StepMessage(0, dense=RawChunk(header=pb.ChunkHeader(length=3000, **HEADER) if i == 0 else None,
                                           offset=1000 * i, data=b"\0" * 4000)) for i in range(3)]
    pull_ids = b"\0" * 8 * 50_000  # 400 KB of pull ids: far past the header allowance, sized by their own check
    rows = pb.RowsChunk(ids=b"\0" * 8 * 10, rows=b"\0" * 4 * 8 * 10)
    rows.header.CopyFrom(pb.RowsHeader(table="emb", num_ids=10, dim=8, pull_ids=pull_ids, **HEADER))
    parts = _parts(serialize_step(one_message([*dense, StepMessage(1, rows=rows)])))
    parts.declare(parts.parts[0], 12_000)  # neither is refused
    parts.declare(parts.parts[1], 10 * (8 + 4 * 8))
