"""A Step call's envelope without a network: StepChunk bytes round-trip with protobuf's generated class both
ways (psserver.protocol.stepwire), and a stream's parts are grouped and refused as psserver.serving.step_parts says."""

from __future__ import annotations

import pytest

from psserver.protocol.errors import InvalidRequest, TooLarge
from psserver.protocol.fastwire import RawChunk
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, pack_serialized, parse_step, serialize_step
from psserver.serving.step_parts import DENSE, ROWS, StepParts


def _dense(part=0, header=True, data=b"\1\2\3\4"):
    h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint="f") if header else None
    return StepMessage(part, dense=RawChunk(header=h, offset=0, data=data))


def _rows(part, table="emb", header=True, rank=0):
    chunk = pb.RowsChunk(ids=b"\0" * 8, rows=b"\0" * 16)
    if header:
        chunk.header.CopyFrom(pb.RowsHeader(rank=rank, trainer_id=f"t{rank}", fingerprint="f", table=table))
    return StepMessage(part, rows=chunk)


def test_step_bytes_read_back_through_the_generated_class_and_back():
    for msg in (_dense(3), _rows(2)):
        wire = serialize_step(msg)
        generated = pb.StepChunk.FromString(wire)
        assert generated.part == msg.part
        back = parse_step(generated.SerializeToString())
        assert back.part == msg.part and not back.malformed and back.nbytes == len(wire)
        if msg.dense is not None:
            assert bytes(back.dense.data) == bytes(msg.dense.data) and back.dense.header == msg.dense.header
        else:
            assert back.rows == msg.rows


def test_a_small_step_in_one_message_reads_back_as_its_chunks_in_order():
    msgs = [_dense(0), _rows(1), _rows(2, "other")]
    wire = serialize_step(one_message(msgs))
    assert len(pb.StepChunk.FromString(wire).more) == 2  # the generated class reads it too
    back = parse_step(wire)
    assert [m.part for m in back.flat()] == [0, 1, 2] and back.flat()[2].rows == msgs[2].rows
    parts = _collect([back])
    assert [(p.index, p.kind) for p in parts] == [(0, DENSE), (1, ROWS), (2, ROWS)]


def test_a_chunk_in_more_with_more_of_its_own_is_malformed():
    inner = one_message([_rows(1), _rows(2, "b")])
    assert "carries `more` of its own" in parse_step(serialize_step(StepMessage(0, dense=_dense().dense,
                                                                                  more=[inner]))).malformed


def test_a_reply_packed_from_serialized_messages_has_the_bytes_of_one_message():
    msgs = [_dense(0), _dense(0, header=False, data=b"\5" * 300), _rows(1), _rows(2, "other")]
    wire = pack_serialized([serialize_step(m) for m in msgs])
    assert wire == serialize_step(one_message(msgs))
    back = parse_step(wire)
    assert [m.part for m in back.flat()] == [0, 0, 1, 2] and bytes(back.flat()[1].dense.data) == b"\5" * 300
    assert serialize_step(wire) is wire  # already serialized: written as it is


def test_one_reply_reads_back_on_the_message_and_through_the_generated_class():
    wire = serialize_step(one_message([_dense(0), _rows(1)], one_reply=True))
    assert pb.StepChunk.FromString(wire).one_reply and parse_step(wire).one_reply
    assert not parse_step(serialize_step(one_message([_dense(0), _rows(1)]))).one_reply


def test_one_reply_on_a_chunk_in_more_is_malformed():
    nested = StepMessage(0, dense=_dense().dense, more=[StepMessage(1, rows=_rows(1).rows, one_reply=True)])
    assert "a chunk in `more` sets one_reply" in parse_step(serialize_step(nested)).malformed


def test_one_reply_is_taken_from_the_first_message_and_refused_on_a_later_one():
    first = _dense(0)
    first.one_reply = True
    collected = StepParts(1 << 20, min_chunk_bytes=1)
    collected.add(parse_step(serialize_step(first)))
    assert collected.one_reply
    later = _rows(1)
    later.one_reply = True
    with pytest.raises(InvalidRequest, match="one_reply is set on message 2 .* only the first message may set it"):
        collected.add(parse_step(serialize_step(later)))


def test_malformed_step_bytes_are_marked_not_raised():
    assert "malformed StepChunk" in parse_step(b"\x12\x50\x01").malformed  # a field past the end
    assert "not a StepChunk field" in parse_step(b"\x20\x01").malformed


def _collect(msgs, max_bytes=1 << 20, min_chunk_bytes=1):
    parts = StepParts(max_bytes, min_chunk_bytes=min_chunk_bytes)
    for m in msgs:
        parts.add(m)
    return parts.finish()


def test_parts_are_grouped_in_order_with_their_chunks():
    parts = _collect([_dense(0), _dense(0, header=False), _rows(1), _rows(2, "other")])
    assert [(p.index, p.kind, len(p.chunks)) for p in parts] == [(0, DENSE, 2), (1, ROWS, 1), (2, ROWS, 1)]
    assert parts[2].header.table == "other"


def test_a_chunk_under_the_minimum_followed_by_another_of_its_part_is_refused_as_that_one_arrives():
    parts = StepParts(1 << 20, min_chunk_bytes=8)
    parts.add(_dense(0))  # 4 bytes: fine while it may be the part's last
    with pytest.raises(InvalidRequest, match="part 0's chunk at offset 0 carries 4 bytes, under the minimum of 8"):
        parts.add(_dense(0, header=False))
    rows = StepParts(1 << 20, min_chunk_bytes=32)
    rows.add(_rows(0))  # 8 bytes of ids and 16 of rows
    with pytest.raises(InvalidRequest, match="carries 24 bytes, under the minimum of 32"):
        rows.add(_rows(0, header=False))


def test_a_short_last_chunk_of_each_part_is_taken():
    parts = _collect([_dense(0, data=b"\0" * 8), _dense(0, header=False), _rows(1), _rows(2, "other")],
                     min_chunk_bytes=8)
    assert [len(p.chunks) for p in parts] == [2, 1, 1]


@pytest.mark.parametrize("msgs, error, fragment", [
    ([], InvalidRequest, "the Step stream is empty"),
    ([_rows(1)], InvalidRequest, "part is 1 but -1 or 0 was expected"),
    ([_dense(0), _rows(0)], InvalidRequest, "part 0 is dense but a chunk of it carries rows"),
    ([_dense(0), _rows(1), _dense(0)], InvalidRequest, "part is 0 but 1 or 2 was expected"),
    ([_dense(0), _dense(1)], InvalidRequest, "part 1 is a second dense part"),
    ([_rows(0), _rows(1)], InvalidRequest, "part 1 names table 'emb', as part 0 did"),
    ([_rows(0), _rows(1, "b", rank=1)], InvalidRequest, "part 1 names rank 1"),
    ([_rows(0, header=False)], InvalidRequest, "part 0's first chunk has no header"),
    ([StepMessage(0)], InvalidRequest, "carries neither dense nor rows"),
    ([StepMessage(malformed="malformed StepChunk message: x")], InvalidRequest, "malformed StepChunk"),
])
def test_a_malformed_envelope_is_refused_naming_the_field(msgs, error, fragment):
    with pytest.raises(error, match=fragment):
        _collect(msgs)


def test_the_stream_bytes_and_the_number_of_parts_are_bounded():
    with pytest.raises(TooLarge, match="over this shard's limit of 10 bytes"):
        _collect([StepMessage(0, dense=RawChunk(data=b"x"), nbytes=11)], max_bytes=10)
    parts = StepParts(1 << 20, max_parts=2)
    parts.add(_dense(0))
    parts.add(_rows(1))
    with pytest.raises(TooLarge, match="past the limit of 2 parts"):
        parts.add(_rows(2, "b"))


def test_a_parts_chunks_past_what_its_header_declares_are_refused_as_the_chunk_that_passes_it_arrives():
    """Before: a part was bounded only by the stream's --max-push-bytes, whatever its header declared (a dense part
    of a 4 KB slice could bring gigabytes, kept until the stream ended)."""
    parts = StepParts(1 << 20, min_chunk_bytes=1)
    parts.add(_dense(0, data=b"\0" * 8))
    parts.declare(parts.parts[0], 12)  # the header checked: 12 bytes declared, 8 carried so far
    parts.add(_dense(0, header=False, data=b"\0" * 4))  # 12: still within it
    with pytest.raises(InvalidRequest, match="part 0 carries 16 bytes so far but its header declares 12 bytes"):
        parts.add(_dense(0, header=False, data=b"\0" * 4))
    first = StepParts(1 << 20, min_chunk_bytes=1)
    first.add(_rows(0))  # 24 bytes in its first chunk, declared 8: refused at the declaration
    with pytest.raises(InvalidRequest, match="part 0 carries 24 bytes so far but its header declares 8 bytes"):
        first.declare(first.parts[0], 8)


def test_a_step_message_of_more_chunks_than_the_cap_or_of_repeated_fields_is_malformed_before_it_is_read_whole():
    """Parsed on the shard's loop before any check: 8M empty `more` entries were 8M Python objects."""
    many = b"\x22\x00" * 10
    assert "`more` carries more than 9 chunks" in parse_step(many, max_more=9).malformed
    assert not parse_step(serialize_step(one_message([_dense(0)] * 9)), max_more=9).malformed
    assert "more than 16 fields besides `more`" in parse_step(b"\x08\x01" * 17).malformed
    assert not parse_step(b"\x08\x01" * 16).malformed
    assert "more than 16 fields" in parse_step(b"\x22\x22" + b"\x08\x01" * 17).malformed  # inside an entry too
