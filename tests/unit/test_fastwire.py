"""psserver.protocol.fastwire writes and reads exactly protobuf's bytes for Chunk, both ways."""

from hypothesis import given, settings
from hypothesis import strategies as st

from psserver.protocol.fastwire import RawChunk, parse_chunk, serialize_chunk
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
