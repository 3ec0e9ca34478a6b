"""Top-k pushes over the wire: a real shard bounds them (state unchanged on refusal) and applies them exactly;
trainers with compress="topk:1.0" train bit for bit as dense ones."""

import copy
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from psserver.protocol.codec import encode, encode_topk_raw, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused
from trainer.stepping.api import connect
from trainer.workloads.data import epoch_order, load_dataset, local_batch_indices
from trainer.workloads.models import build_model

FP = "f" * 16
C = grpc.StatusCode
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def topk_chunks(indices, values, rank=1, k=None, chunk_bytes=1 << 20, dtype=pb.FLOAT32, **fields):
    """Generated Chunk messages of a top-k push; ``k`` overrides the header's count (to break it)."""
    idx = torch.tensor(indices, dtype=torch.int32)
    vals = torch.tensor(values, dtype=torch.float32).to({pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16,
                                                         pb.BFLOAT16: torch.bfloat16}[dtype])
    header = pb.ChunkHeader(rank=rank, trainer_id=f"t{rank}", fingerprint=FP, dtype=dtype, length=P, version=0,
                            num_samples=4, topk=len(indices), **fields)
    raw = encode_topk_raw(idx, vals, header, chunk_bytes)
    chunks = [pb.Chunk(offset=c.offset, data=bytes(c.data)) for c in raw]
    chunks[0].header.CopyFrom(header)
    if k is not None:
        chunks[0].header.topk = k
    return chunks


def send(shard, chunks, rpc):
    if rpc == "Push":
        return shard.push_chunks(chunks)
    return list(shard.stub.PushPull(iter(chunks), timeout=10))


def expect_refused(shard, chunks, rpc, words):
    refused(lambda: send(shard, chunks, rpc), C.INVALID_ARGUMENT, words, unchanged=shard)


BAD = [
    ("unsorted", dict(indices=[5, 3, 9], values=[1.0, 2.0, 3.0]), "strictly increasing: index 1 is 3 after 5"),
    ("repeated", dict(indices=[3, 3], values=[1.0, 2.0]), "strictly increasing: index 1 is 3 after 3"),
    ("negative", dict(indices=[-4, 3], values=[1.0, 2.0]), "top-k index 0 is -4, below 0"),
    ("out of range", dict(indices=[3, P], values=[1.0, 2.0]), f"top-k index 1 is {P}, out of this shard's slice"),
    ("k over the slice", dict(indices=[1, 2], values=[1.0, 2.0], k=P + 1),
     f"topk is {P + 1} pairs but this shard's slice has only {P} elements"),
    ("fewer pairs than k", dict(indices=list(range(40)), values=[1.0] * 40, k=41),  # one chunk over the minimum
     "the chunks cover 320 bytes but topk 41 pairs need 328"),
    ("more pairs than k", dict(indices=[1, 2, 3], values=[1.0, 2.0, 3.0], k=2),
     "past the end of the top-k payload of 16 bytes"),
    ("non-finite value", dict(indices=[1, 2], values=[1.0, float("nan")]), "NaN or infinite"),
    ("wrong length", dict(indices=[1, 2], values=[1.0, 2.0], length=P - 1),
     f"length is {P - 1} elements but this shard's slice has {P}"),
]


@pytest.mark.parametrize("rpc", ["Push", "PushPull"])
@pytest.mark.parametrize("name,push,words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_top_k_push_is_refused_and_changes_nothing(open_round_shard, rpc, name, push, words):
    push = dict(push)
    length = push.pop("length", None)
    chunks = topk_chunks(**push)
    if length is not None:
        chunks[0].header.length = length
    expect_refused(open_round_shard, chunks, rpc, words)


@SETTINGS
@given(data=st.data(), rpc=st.sampled_from(["Push", "PushPull"]))
def test_generated_broken_indices_are_refused_and_change_nothing(open_round_shard, data, rpc):
    """Sorted in-range indices with one broken in a generated way: unsorted, repeated or out of range."""
    good = sorted(data.draw(st.sets(st.integers(0, P - 1), min_size=2, max_size=40)))
    i = data.draw(st.integers(0, len(good) - 1))
    bad = data.draw(st.one_of(st.integers(P, 2**31 - 1), st.integers(-2**31, -1),
                              st.sampled_from([good[i - 1]] if i else [good[1]])))  # repeats a neighbour
    indices = list(good)
    indices[i] = bad
    expect_refused(open_round_shard, topk_chunks(indices, [1.0] * len(indices)), rpc, "top-k ")


def test_the_shard_still_serves_after_refusals_and_applies_a_top_k_push_exactly(open_round_shard):
    """Rank 1 closes the open round with 3 pairs: the average is (ones*4 + pairs*4) / 8, stepped by SGD."""
    test_a_bad_top_k_push_is_refused_and_changes_nothing(open_round_shard, "Push", *BAD[0])  # refusals came first
    reply = open_round_shard.push_chunks(topk_chunks([0, 7, 999], [2.0, -6.0, 0.5]))
    assert reply.outcome == pb.APPLIED and reply.version == 1
    version, weights = open_round_shard.pull(min_version=1)
    sparse = torch.zeros(P)
    sparse[[0, 7, 999]] = torch.tensor([2.0, -6.0, 0.5])
    want = torch.zeros(P) - 0.5 * ((torch.ones(P) * 4 + sparse * 4) / 8)  # sgd lr 0.5, first momentum step
    assert version == 1 and torch.equal(weights, want)
    assert open_round_shard.stats().counters["topk_pushes"] >= 1


@pytest.mark.parametrize("dtype", [pb.FLOAT16, pb.BFLOAT16])
def test_a_top_k_push_in_a_narrow_wire_dtype_equals_the_dense_push_of_its_pairs(shard_server, dtype):
    sparse_shard, dense_shard = shard_server(shard=0), shard_server(shard=0)
    for s in (sparse_shard, dense_shard):
        s.register(rank=0, spec=make_spec(wire_dtype={pb.FLOAT16: "float16", pb.BFLOAT16: "bfloat16"}[dtype]))
        s.stub.Init(encode(wire_tensor(torch.zeros(P), dtype), s.header(dtype=dtype), 1024), timeout=10)
    idx, vals = [1, 50, 998], [0.1, -3.3, 7.0]
    reply = sparse_shard.push_chunks(topk_chunks(idx, vals, rank=0, dtype=dtype))
    dense = torch.zeros(P)
    dense[idx] = torch.tensor(vals)
    dense_shard.push(dense, dtype=dtype)
    assert reply.outcome == pb.APPLIED
    assert torch.equal(sparse_shard.pull()[1], dense_shard.pull()[1])


def test_init_refuses_a_top_k_header(shard_server):
    s = shard_server()
    s.register(rank=0)
    chunks = topk_chunks([1, 2], [1.0, 2.0], rank=0)
    refused(lambda: s.stub.Init(iter(chunks), timeout=10), C.INVALID_ARGUMENT,
            "topk is 2 but this stream carries dense values", unchanged=s)
    assert not s.stats().initialized


def test_a_non_finite_top_k_push_is_skipped_under_nonfinite_skip(shard_server):
    s = shard_server(nonfinite="skip")
    s.register(rank=0)
    s.init(torch.zeros(P))
    reply = s.push_chunks(topk_chunks([1, 2], [1.0, float("inf")], rank=0))
    assert reply.outcome == pb.SKIPPED
    assert torch.equal(s.pull()[1], torch.zeros(P))


# ---------------------------------------------------------------------- trainers
STEPS, B = 6, 8


def train(addresses, rank, num_trainers, model, data, **kw):
    """``STEPS`` sync steps of the MLP for one trainer; its model's state afterwards."""
    order = epoch_order(len(data.x_train), seed=0, epoch=0)
    with connect(addresses, model, mode="sync", rank=rank, num_trainers=num_trainers, trainer_id=f"r{rank}",
                 optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, **kw) as ps:
        for k in range(STEPS):
            if kw.get("push_during_backward"):
                ps.prepare_step(B)
            idx = local_batch_indices(order, k, rank=rank, num_trainers=num_trainers, batch_size=B)
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            ps.step(num_samples=len(idx))
        counters = ps.counters
    return copy.deepcopy(model.state_dict()), counters


def run_job(shard_server, num_trainers=2, **kw):
    shards = [shard_server(shard=i) for i in range(2)]
    addresses = ",".join(s.server.address for s in shards)
    data = load_dataset("synthetic", "mlp")
    models = [build_model("mlp", data.shape, seed=0) for _ in range(num_trainers)]  # here: seeding is global
    with ThreadPoolExecutor(num_trainers) as pool:
        runs = list(pool.map(lambda r: train(addresses, r, num_trainers, models[r], data, **kw),
                             range(num_trainers)))
    return runs, [s.stats().counters for s in shards]


def test_a_sync_run_with_top_k_ratio_one_equals_the_dense_run_bit_for_bit(shard_server):
    dense, _ = run_job(shard_server)
    sparse, shard_counters = run_job(shard_server, compress="topk:1.0")
    for (want, _), (got, counters) in zip(dense, sparse):
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert counters["push_bytes_sent"] == 2 * counters["push_bytes_dense"]  # (index, value) pairs, every one
    assert all(c["topk_pushes"] == 2 * STEPS for c in shard_counters)  # both trainers' pushes went sparse
    initial = build_model("mlp", load_dataset("synthetic", "mlp").shape, seed=0).state_dict()
    assert any(not torch.equal(dense[0][0][n], initial[n]) for n in initial)  # it trained


def test_top_k_pushed_during_backward_equals_top_k_pushed_in_step(shard_server):
    in_step, _ = run_job(shard_server, num_trainers=1, compress="topk:0.05")
    early, shard_counters = run_job(shard_server, num_trainers=1, compress="topk:0.05", push_during_backward=True)
    (want, wc), (got, gc) = in_step[0], early[0]
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert gc["push_bytes_sent"] == wc["push_bytes_sent"] < gc["push_bytes_dense"] / 5
    assert all(c["topk_pushes"] == STEPS for c in shard_counters)


def test_a_bad_compress_value_is_refused_before_connecting():
    model = build_model("mlp", (1, 28, 28), seed=0)
    with pytest.raises(ValueError, match=r"--compress \(topk:2\): the ratio \(2\) must be above 0 and at most 1"):
        connect("127.0.0.1:1", model, compress="topk:2", connect_timeout=0.1)
