"""Top-k with error feedback (trainer.channels.compress) and the top-k wire format (psserver.protocol.codec), without network."""

import math
from collections import Counter

import pytest
import torch

from psserver.protocol.codec import (
    INT32_INDEX_LIMIT,
    ChunkAssembler,
    TopKAssembler,
    check_stream_header,
    encode_topk_raw,
    index_dtype,
)
from psserver.protocol.errors import InvalidRequest, TooLarge
from psserver.protocol.proto import ps_pb2 as pb
from trainer.channels.client import ShardClient
from trainer.channels.compress import CompressSpec, TopK, parse_compress

N = 1000


def header(k, n=N, dtype=pb.FLOAT32):
    return pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint="f" * 16, dtype=dtype, length=n, version=0,
                          num_samples=1, topk=k)


def assemble(chunks, n=N, dtype=pb.FLOAT32, max_bytes=1 << 30, min_chunk_bytes=0):
    asm = TopKAssembler(chunks[0].header, n, dtype, max_bytes, min_chunk_bytes=min_chunk_bytes)
    for c in chunks:
        asm.add(c)
    return asm.finish()


# ---------------------------------------------------------------------- --compress values
@pytest.mark.parametrize("spec,want", [
    ("topk:0.01", CompressSpec(0.01)), ("topk:1", CompressSpec(1.0)), (" topk:0.5 ", CompressSpec(0.5)),
    ("topk:0.01,warmup=15", CompressSpec(0.01, 15)), ("", None), ("none", None), (None, None)])
def test_compress_values_parse_to_their_ratio_and_warmup(spec, want):
    assert parse_compress(spec) == want


@pytest.mark.parametrize("spec,words", [
    ("topk:0", "the ratio (0) must be above 0 and at most 1"),
    ("topk:1.5", "the ratio (1.5) must be above 0 and at most 1"),
    ("topk:-0.1", "the ratio (-0.1)"),
    ("topk:nan", "the ratio (nan)"),
    ("topk:abc", "the ratio (abc) is not a number"),
    ("topk", "is not a known compression"),
    ("randk:0.1", "is not a known compression"),
    ("topk:0.1,warmup=-1", "the option (warmup=-1) is not warmup=STEPS"),
    ("topk:0.1,warm=3", "the option (warm=3) is not warmup=STEPS"),
])
def test_bad_compress_values_are_refused_naming_the_value_with_a_hint(spec, words):
    with pytest.raises(ValueError) as e:
        parse_compress(spec)
    assert f"--compress ({spec})" in str(e.value) and words in str(e.value)
    assert "topk:RATIO[,warmup=STEPS] with 0 < RATIO <= 1" in str(e.value)


# ---------------------------------------------------------------------- error feedback
def test_k_is_the_ratio_of_the_slice_rounded_up_and_at_least_one():
    assert TopK(0.01).k_for(1000) == 10
    assert TopK(0.01).k_for(1001) == 11
    assert TopK(0.01).k_for(5) == 1
    assert TopK(1.0).k_for(7) == 7


def test_the_largest_magnitudes_are_sent_with_strictly_increasing_int32_indices():
    g = torch.zeros(N)
    g[[900, 3, 500]] = torch.tensor([-5.0, 4.0, 3.0])
    g[10] = 0.5
    idx, values = TopK(0.003).compress(g, pb.FLOAT32)
    assert idx.dtype == torch.int32 and idx.tolist() == [3, 500, 900]
    assert values.tolist() == [4.0, 3.0, -5.0]


def test_each_push_splits_residual_plus_gradient_exactly_into_sent_and_kept():
    """Bit for bit, every step: residual_before + grad == residual_after + what was sent."""
    torch.manual_seed(0)
    tk = TopK(0.05)
    residual = torch.zeros(N)
    for _ in range(20):
        g = torch.randn(N)
        before = residual + g
        idx, values = tk.compress(g, pb.FLOAT32)
        sent = torch.zeros(N)
        sent[idx.long()] = values
        assert torch.equal(tk.residual + sent, before)
        assert torch.equal(tk.residual[idx.long()], torch.zeros(len(idx)))  # fp32 sends an entry whole
        residual = tk.residual.clone()


def test_everything_sent_plus_the_residual_is_the_sum_of_all_gradients():
    """Over many pushes nothing is lost, only delayed.  Gradients of multiples of 2^-8 in a small range add
    exactly in fp32, so the sums agree bit for bit in any order."""
    gen = torch.Generator().manual_seed(1)
    tk = TopK(0.01)
    total_grad, total_sent = torch.zeros(N), torch.zeros(N)
    for _ in range(50):
        g = torch.randint(-512, 512, (N,), generator=gen).float() / 256
        total_grad += g
        idx, values = tk.compress(g, pb.FLOAT32)
        total_sent[idx.long()] += values
    assert torch.equal(total_sent + tk.residual, total_grad)
    assert float(tk.residual.abs().sum()) > 0  # a ratio of 1% left plenty unsent: the test exercises the residual


def test_a_narrow_wire_dtype_keeps_its_rounding_error_in_the_residual():
    torch.manual_seed(2)
    tk = TopK(0.1)
    g = torch.randn(N) / 3
    idx, values = tk.compress(g, pb.BFLOAT16)
    assert values.dtype == torch.bfloat16
    sent = torch.zeros(N)
    sent[idx.long()] = values.float()
    assert torch.equal(tk.residual + sent, g)
    assert float(tk.residual[idx.long()].abs().max()) > 0  # bf16 dropped low bits, and they were kept


def test_ratio_one_sends_the_whole_gradient_and_keeps_nothing():
    tk = TopK(1.0)
    for seed in range(3):
        g = torch.randn(N, generator=torch.Generator().manual_seed(seed))
        idx, values = tk.compress(g, pb.FLOAT32)
        assert idx.tolist() == list(range(N)) and torch.equal(values, g)
        assert not bool(tk.residual.any())


def test_a_non_finite_gradient_is_sent_to_the_shard_but_not_kept_in_the_residual():
    tk = TopK(0.01)
    g = torch.ones(N)
    g[7] = float("nan")
    idx, values = tk.compress(g, pb.FLOAT32)
    assert 7 in idx.tolist() and math.isnan(float(values[idx.tolist().index(7)]))
    assert bool(torch.isfinite(tk.residual).all())


def test_a_slice_of_another_length_is_refused():
    tk = TopK(0.5)
    tk.compress(torch.ones(4), pb.FLOAT32)
    with pytest.raises(ValueError, match="the gradient slice has 5 elements but this residual has 4"):
        tk.compress(torch.ones(5), pb.FLOAT32)


# ---------------------------------------------------------------------- the client resends, never recompresses
def test_an_unanswered_compressed_push_is_resent_as_it_was_not_compressed_again():
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f" * 16, counters=Counter(),
                         chunk_bytes=64, compressor=TopK(0.1))
    try:
        g = torch.arange(N, dtype=torch.float32)
        first = client.dense.gradient_chunks(g, 0, 1, pb.FLOAT32)
        residual = client.compressor.residual.clone()
        again = client.dense.gradient_chunks(g, 0, 1, pb.FLOAT32)  # the step failed and is retried
        assert again is first and torch.equal(client.compressor.residual, residual)
        nbytes, dense_bytes, chunks = first
        assert (nbytes, dense_bytes) == (100 * 8, N * 4) and chunks[0].header.topk == 100
        assert chunks[0].header.sequence == 1
        client.dense.acknowledged("accepted", 1, 0, 0, nbytes, dense_bytes)
        nxt = client.dense.gradient_chunks(g, 1, 1, pb.FLOAT32)  # answered: the next push is a new one
        assert nxt[2][0].header.sequence == 2 and not torch.equal(client.compressor.residual, residual)
        assert client.calls.counters["push_bytes_sent"] == 800 and client.calls.counters["push_bytes_dense"] == 4000
    finally:
        client.close()


def test_after_a_restart_an_unanswered_compressed_push_goes_again_as_it_was_under_a_new_number_and_base():
    """The restarted shard forgot the push (trainer.stepping.exchange's exchange_slot pushes it again on the version it resumed at):
    its pairs again, not a second compression of the gradient into the residual."""
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f" * 16, counters=Counter(), compressor=TopK(0.1))
    try:
        g = torch.arange(N, dtype=torch.float32)
        first = client.dense.gradient_chunks(g, 7, 1, pb.FLOAT32)
        residual = client.compressor.residual.clone()
        assert client.dense.resend_after_restart()
        again = client.dense.gradient_chunks(g, 5, 1, pb.FLOAT32)
        assert again is first and torch.equal(client.compressor.residual, residual)
        assert (again[2][0].header.sequence, again[2][0].header.version) == (2, 5)
        assert client.dense.next_sequence() == 2
    finally:
        client.close()


def test_after_a_restart_an_answered_compressed_push_is_abandoned_not_compressed_again():
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f" * 16, counters=Counter(), compressor=TopK(0.1))
    try:
        g = torch.arange(N, dtype=torch.float32)
        nbytes, dense_bytes, _ = client.dense.gradient_chunks(g, 0, 1, pb.FLOAT32)
        client.dense.acknowledged("applied", 1, 0, 0, nbytes, dense_bytes)  # its pairs are gone with the old process
        assert not client.dense.resend_after_restart()
        assert client.dense.next_sequence() == 2 and not client.dense.unanswered
    finally:
        client.close()


@pytest.mark.parametrize("answered", [False, True])
def test_after_a_restart_a_dense_push_goes_again_from_the_gradient_under_a_new_number(answered):
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f" * 16, counters=Counter())
    try:
        g = torch.arange(N, dtype=torch.float32)
        nbytes, dense_bytes, _ = client.dense.gradient_chunks(g, 3, 1, pb.FLOAT32)
        if answered:
            client.dense.acknowledged("applied", 4, 0, 3, nbytes, dense_bytes)
        assert client.dense.resend_after_restart()
        _, _, chunks = client.dense.gradient_chunks(g, 2, 1, pb.FLOAT32)
        assert (chunks[0].header.sequence, chunks[0].header.version, chunks[0].header.length) == (2, 2, N)
    finally:
        client.close()


def test_warm_up_pushes_go_dense_and_a_retried_one_is_resent_dense_without_counting_twice():
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f" * 16, counters=Counter(), compressor=TopK(0.1, warmup=2))
    try:
        g = torch.arange(N, dtype=torch.float32)
        kinds = []
        for _ in range(3):
            nbytes, dense_bytes, chunks = client.dense.gradient_chunks(g, 0, 1, pb.FLOAT32)
            retried = client.dense.gradient_chunks(g, 0, 1, pb.FLOAT32)
            assert retried[2][0].header == chunks[0].header  # the same push again, same sequence
            kinds.append(chunks[0].header.topk)
            client.dense.acknowledged("applied", 1, 0, 0, nbytes, dense_bytes)
        assert kinds == [0, 0, 100]
        assert client.compressor.residual is not None and float(client.compressor.residual.sum()) > 0
    finally:
        client.close()


# ---------------------------------------------------------------------- wire format
@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16])
@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_top_k_pairs_round_trip_into_a_dense_slice(dtype, chunk_bytes):
    torch.manual_seed(3)
    tk = TopK(0.05)
    idx, values = tk.compress(torch.randn(N), dtype)
    chunks = encode_topk_raw(idx, values, header(len(idx), dtype=dtype), chunk_bytes)
    assert [c.offset for c in chunks] == list(range(0, len(idx) * (4 + values.element_size()), chunk_bytes))
    dense = assemble(chunks, dtype=dtype)
    want = torch.zeros(N)
    want[idx.long()] = values.float()
    assert torch.equal(dense, want)


def test_slices_over_two_to_the_31_elements_use_int64_indices():
    assert index_dtype(INT32_INDEX_LIMIT) == torch.int32
    assert index_dtype(INT32_INDEX_LIMIT + 1) == torch.int64
    n = INT32_INDEX_LIMIT + 5
    idx = torch.tensor([0, INT32_INDEX_LIMIT, n - 1], dtype=torch.int64)
    chunks = encode_topk_raw(idx, torch.tensor([1.0, 2.0, 3.0]), header(3, n=n))
    asm = TopKAssembler(chunks[0].header, n, pb.FLOAT32, 1 << 30)
    for c in chunks:
        asm.add(c)
    got, values = asm.pairs()  # not scattered: a dense slice of 2^31 floats is 8 GB
    assert got.tolist() == idx.tolist() and values.tolist() == [1.0, 2.0, 3.0]


def pairs_chunks(indices, values=None, k=None, chunk_bytes=1 << 20):
    idx = torch.tensor(indices, dtype=torch.int32)
    vals = torch.ones(len(indices)) if values is None else torch.tensor(values)
    chunks = encode_topk_raw(idx, vals, header(len(indices)), chunk_bytes)
    if k is not None:  # a header that does not match the payload
        chunks[0].header = header(k)
    return chunks


@pytest.mark.parametrize("indices,words", [
    ([3, 2, 9], "strictly increasing: index 1 is 2 after 3"),
    ([1, 4, 4], "strictly increasing: index 2 is 4 after 4"),
    ([-1, 4, 5], "top-k index 0 is -1, below 0"),
    ([1, 4, N], f"top-k index 2 is {N}, out of this shard's slice [0, {N})"),
])
def test_bad_indices_are_refused_naming_the_position_and_both_values(indices, words):
    out = torch.full((N,), 7.0)
    asm = TopKAssembler(pairs_chunks(indices)[0].header, N, pb.FLOAT32, 1 << 30, out=out)
    for c in pairs_chunks(indices):
        asm.add(c)
    with pytest.raises(InvalidRequest) as e:
        asm.finish()
    assert words in str(e.value)
    assert torch.equal(out, torch.full((N,), 7.0))  # nothing written before every check passed


def test_k_over_the_slice_length_is_refused_before_anything_is_read():
    with pytest.raises(InvalidRequest, match=f"topk is {N + 1} pairs but this shard's slice has only {N} elements"):
        TopKAssembler(header(N + 1), N, pb.FLOAT32, 1 << 30)
    with pytest.raises(InvalidRequest, match=f"topk is {N + 1} pairs"):
        check_stream_header(header(N + 1), N, pb.FLOAT32, 1 << 30)


def test_a_top_k_payload_over_the_size_limit_is_refused():
    with pytest.raises(TooLarge, match="declares 800 bytes, over this shard's limit of 799 bytes"):
        TopKAssembler(header(100), N, pb.FLOAT32, 799)


def test_a_payload_shorter_than_k_pairs_is_refused():
    chunks = pairs_chunks([1, 2, 3], k=4)  # header says 4 pairs, 3 were sent
    asm = TopKAssembler(chunks[0].header, N, pb.FLOAT32, 1 << 30)
    for c in chunks:
        asm.add(c)
    with pytest.raises(InvalidRequest, match="the chunks cover 24 bytes but topk 4 pairs need 32"):
        asm.finish()


def test_a_payload_longer_than_k_pairs_is_refused():
    chunks = pairs_chunks([1, 2, 3], k=2)
    asm = TopKAssembler(chunks[0].header, N, pb.FLOAT32, 1 << 30)
    with pytest.raises(InvalidRequest, match="holds 24 bytes, past the end of the top-k payload of 16 bytes"):
        asm.add(chunks[0])


def test_chunks_out_of_order_or_repeating_the_header_are_refused():
    chunks = pairs_chunks([1, 2, 3], chunk_bytes=8)
    asm = TopKAssembler(chunks[0].header, N, pb.FLOAT32, 1 << 30)
    asm.add(chunks[0])
    with pytest.raises(InvalidRequest, match="chunk offset is 16 but byte 8 was expected"):
        asm.add(chunks[2])
    chunks[1].header = chunks[0].header
    with pytest.raises(InvalidRequest, match="repeats the header"):
        asm.add(chunks[1])


def test_small_chunks_but_the_last_are_refused_under_a_minimum():
    chunks = pairs_chunks([1, 2, 3], chunk_bytes=8)
    asm = TopKAssembler(chunks[0].header, N, pb.FLOAT32, 1 << 30, min_chunk_bytes=16)
    with pytest.raises(InvalidRequest, match="carries 8 bytes, under the minimum of 16"):
        asm.add(chunks[0])


def test_a_dense_reader_refuses_a_top_k_header():
    with pytest.raises(InvalidRequest, match="topk is 3 but this stream carries dense values"):
        ChunkAssembler(header(3), N, pb.FLOAT32, 1 << 30)


def test_non_finite_values_are_refused_on_request():
    chunks = pairs_chunks([1, 2], values=[1.0, float("inf")])
    with pytest.raises(InvalidRequest, match="NaN or infinite"):
        assemble(chunks)
