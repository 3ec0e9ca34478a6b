"""psserver.protocol.fastwire writes and reads exactly protobuf's bytes for Chunk, both ways."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver.protocol.fastwire import RawChunk, RawRowsChunk, parse_chunk, parse_rows_chunk, serialize_chunk
from psserver.protocol.proto import ps_pb2 as pb

headers = st.one_of(st.none(), st.builds(
    pb.ChunkHeader, rank=st.integers(0, 2**32 - 1), trainer_id=st.text(max_size=20), fingerprint=st.text(max_size=16),
    dtype=st.integers(0, 3), length=st.integers(0, 2**64 - 1), version=st.integers(0, 2**64 - 1),
    num_samples=st.integers(0, 2**32 - 1), sequence=st.integers(0, 2**64 - 1)))


@settings(max_examples=300, deadline=None)
@given(header=headers, offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=3000))
def test_same_bytes_as_protobuf_both_ways(header, offset, data):
    generated = pb.Chunk(offset=offset, data=data)
    if header is not None:
        generated.header.CopyFrom(header)
    raw = RawChunk(header=header, offset=offset, data=memoryview(data))
    wire = serialize_chunk(raw)
    assert pb.Chunk.FromString(wire) == generated
    parsed = parse_chunk(generated.SerializeToString())
    assert not parsed.malformed
    assert (parsed.header, parsed.offset, bytes(parsed.data)) == (header, offset, data)
    assert parsed.HasField("header") == (header is not None)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=200))
def test_garbage_never_raises(garbage):
    chunk = parse_chunk(garbage)
    assert isinstance(chunk.malformed, str)


def test_truncated_message_is_reported_as_malformed():
    wire = serialize_chunk(RawChunk(header=pb.ChunkHeader(length=3), offset=0, data=b"\0" * 12))
    assert "malformed Chunk message" in parse_chunk(wire[:-3]).malformed


def test_a_chunk_of_more_fields_than_the_cap_is_malformed_at_the_first_past_it():
    """Parsed on the shard's loop before any check: 16 MiB of two-byte fields was 8M turns of the parse loop."""
    from psserver.protocol.fastwire import MAX_CHUNK_FIELDS

    assert not parse_chunk(b"\x10\x01" * MAX_CHUNK_FIELDS).malformed
    assert f"more than {MAX_CHUNK_FIELDS} fields" in parse_chunk(b"\x10\x01" * (MAX_CHUNK_FIELDS + 1)).malformed
    assert f"more than {MAX_CHUNK_FIELDS} fields" in parse_chunk(b"\x20\x00" * (1 << 20)).malformed


# ------------------------------------------------------------------------------------------------ RowsChunk
rows_headers = st.one_of(st.none(), st.builds(
    pb.RowsHeader, rank=st.integers(0, 2**32 - 1), trainer_id=st.text(max_size=20), table=st.text(max_size=16),
    version=st.integers(0, 2**64 - 1), num_ids=st.integers(0, 2**64 - 1), dim=st.integers(0, 2**32 - 1),
    pull_ref=st.integers(0, 2**64 - 1), packed_pull_ids=st.binary(max_size=40)))


@settings(max_examples=300, deadline=None)
@given(header=rows_headers, offset=st.integers(0, 2**64 - 1), ids=st.binary(max_size=200),
       rows=st.binary(max_size=3000))
def test_a_rows_chunk_is_protobufs_bytes_both_ways_and_equals_the_generated_message(header, offset, ids, rows):
    generated = pb.RowsChunk(offset=offset, ids=ids, rows=rows)
    if header is not None:
        generated.header.CopyFrom(header)
    raw = RawRowsChunk(header=header, offset=offset, ids=memoryview(ids), rows=memoryview(rows))
    assert raw.SerializeToString() == generated.SerializeToString()
    parsed = parse_rows_chunk(generated.SerializeToString())
    assert parsed == generated and generated == parsed and parsed == raw
    assert (parsed.header, parsed.offset, bytes(parsed.ids), bytes(parsed.rows)) == (header, offset, ids, rows)
    assert parsed.HasField("header") == (header is not None)
    assert parsed != pb.RowsChunk(offset=offset ^ 1, ids=ids, rows=rows)


def test_a_rows_chunk_merges_a_repeated_header_and_skips_unknown_fields_as_protobuf_does():
    wire = (pb.RowsChunk(header=pb.RowsHeader(table="a", rank=3)).SerializeToString()
            + pb.RowsChunk(header=pb.RowsHeader(version=9), rows=b"xy").SerializeToString()
            + bytes((0x38, 5)))  # field 7, a varint: not a RowsChunk field
    assert parse_rows_chunk(wire) == pb.RowsChunk.FromString(wire)


@pytest.mark.parametrize("wire,what", [(b"\x22\x05ab", "runs past the end"), (b"\x0f", "wire type 7 of field 1"),
                                       (b"\x10" * 2 + b"\x10\x01" * 20, "more than 16 fields")])
def test_a_rows_chunk_that_does_not_parse_raises_naming_why(wire, what):
    with pytest.raises(ValueError, match=what):
        parse_rows_chunk(wire)
