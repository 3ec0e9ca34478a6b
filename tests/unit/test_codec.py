"""Chunk encoding and the reader's checks, without a network."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver.protocol.codec import ChunkReader, encode, wire_tensor
from psserver.protocol.errors import InvalidRequest, TooLarge
from psserver.protocol.proto import ps_pb2 as pb

BIG = 1 << 40


def chunks_of(t: torch.Tensor, wire=pb.FLOAT32, chunk_bytes=64, **header):
    h = pb.ChunkHeader(dtype=wire, length=t.numel(), **header)
    return list(encode(wire_tensor(t, wire), h, chunk_bytes))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), chunk_bytes=st.integers(16, 200))
def test_roundtrip_any_length_and_chunk_size(n, chunk_bytes):
    t = torch.randn(n)
    chunks = chunks_of(t, chunk_bytes=chunk_bytes)
    assert chunks[0].HasField("header") and not any(c.HasField("header") for c in chunks[1:])
    out = ChunkReader(chunks).read(n, pb.FLOAT32, BIG)
    assert torch.equal(out, t)


@pytest.mark.parametrize("wire,dtype", [(pb.FLOAT16, torch.float16), (pb.BFLOAT16, torch.bfloat16)])
def test_reduced_precision_roundtrip_equals_a_cast(wire, dtype):
    t = torch.randn(101)
    out = ChunkReader(chunks_of(t, wire=wire, chunk_bytes=30)).read(101, wire, BIG)
    assert out.dtype == torch.float32
    assert torch.equal(out, t.to(dtype).float())


def test_missing_header_and_empty_stream_are_refused():
    with pytest.raises(InvalidRequest, match="empty"):
        ChunkReader([])
    with pytest.raises(InvalidRequest, match="no header"):
        ChunkReader([pb.Chunk(offset=0, data=b"\0" * 4)])


def test_wrong_length_and_dtype_name_both_values():
    chunks = chunks_of(torch.zeros(10))
    with pytest.raises(InvalidRequest, match=r"length is 10 elements but this shard's slice has 12"):
        ChunkReader(chunks).read(12, pb.FLOAT32, BIG)
    with pytest.raises(InvalidRequest, match=r"dtype is float32 but this job sends float16"):
        ChunkReader(chunks).read(10, pb.FLOAT16, BIG)


def test_gap_overlap_repeat_and_overflow_are_refused():
    chunks = chunks_of(torch.zeros(48), chunk_bytes=64)  # 3 chunks of 16 elements
    with pytest.raises(InvalidRequest, match="offset is 32 but 16 was expected"):
        ChunkReader([chunks[0], chunks[2]]).read(48, pb.FLOAT32, BIG)
    with pytest.raises(InvalidRequest, match="offset 0 repeats the header"):
        ChunkReader([chunks[0], chunks[0]]).read(48, pb.FLOAT32, BIG)
    with pytest.raises(InvalidRequest, match="offset is 0 but 16 was expected"):
        ChunkReader([chunks[0], pb.Chunk(offset=0, data=chunks[1].data)]).read(48, pb.FLOAT32, BIG)
    with pytest.raises(InvalidRequest, match="cover \\[0, 32\\)"):
        ChunkReader(chunks[:2]).read(48, pb.FLOAT32, BIG)
    extra = pb.Chunk(offset=48, data=b"\0" * 4)
    with pytest.raises(InvalidRequest, match="arrived after the stream covered"):
        ChunkReader(chunks + [extra]).read(48, pb.FLOAT32, BIG)
    repeat = pb.Chunk(header=chunks[0].header, offset=16, data=chunks[1].data)
    with pytest.raises(InvalidRequest, match="repeats the header"):
        ChunkReader([chunks[0], repeat, chunks[2]]).read(48, pb.FLOAT32, BIG)
    odd = pb.Chunk(offset=16, data=b"\0" * 5)
    with pytest.raises(InvalidRequest, match="not a multiple of 4"):
        ChunkReader([chunks[0], odd]).read(48, pb.FLOAT32, BIG)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_with_position(bad):
    t = torch.zeros(20)
    t[13] = bad
    with pytest.raises(InvalidRequest, match="1 values are NaN or infinite \\(first at element 13"):
        ChunkReader(chunks_of(t)).read(20, pb.FLOAT32, BIG)


def test_stream_over_the_size_limit_is_refused_before_reading():
    with pytest.raises(TooLarge, match="declares 400 bytes, over this shard's limit of 100 bytes"):
        ChunkReader(chunks_of(torch.zeros(100))).read(100, pb.FLOAT32, 100)


def test_finite_values_whose_sum_overflows_are_accepted():
    t = torch.tensor([3e38, 3e38, -3e38, -3e38, 1.0])
    out = ChunkReader(chunks_of(t)).read(5, pb.FLOAT32, BIG)
    assert torch.equal(out, t)
