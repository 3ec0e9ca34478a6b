"""Property-based bad input for every RPC: the documented status, and the shard's state hash unchanged.

Each generated request is a valid one with one field broken in a generated way,
so the expected status follows from which field was broken (README, "Status codes").
"""

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.limits import MAX_ID_CHARS, MAX_TOTAL_PARAMS, MAX_TRAINERS
from psserver.protocol.proto import ps_pb2 as pb
from psserver.server import ServerConfig, ShardServer
from psserver.service import ServiceLimits
from tests.conftest import P, RawShard, make_spec

FP = "f" * 16
MAX_PUSH = 1 << 20
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
C = grpc.StatusCode


@pytest.fixture(scope="module")
def shard():
    """Sync job of 2 trainers; rank 0 registered and initialised; one open round (rank 0 pushed at version 0)."""
    # Leases off: a lease running out would close the open round mid-test and change the state on its own.
    server = ShardServer(ServerConfig(shard=0, host="127.0.0.1", port=0, max_push_bytes=MAX_PUSH,
                                      lease_timeout=0, limits=ServiceLimits(min_chunk_bytes=256))).start()
    s = RawShard(server)
    s.register(rank=0, spec=make_spec(num_trainers=2))
    s.register(rank=1, spec=make_spec(num_trainers=2))
    s.init(torch.zeros(P))
    s.push(torch.ones(P), rank=0)  # accepted into round 0: the open round is part of the hashed state
    yield s
    server.stop(grace=0)


def expect(shard, call, code):
    before = shard.digest()
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert e.value.details(), "every refusal carries a message"
    assert shard.digest() == before


def good_header(**overrides):
    fields = dict(rank=1, trainer_id="t1", fingerprint=FP, dtype=pb.FLOAT32, length=P, version=0, num_samples=4)
    fields.update(overrides)
    return pb.ChunkHeader(**fields)


def chunks_for(header, values=None, chunk_bytes=1024):
    """Chunks of ``values`` as float32, with ``header`` (possibly broken) on the first one."""
    values = torch.ones(P) if values is None else values
    chunks = list(encode(wire_tensor(values, pb.FLOAT32), good_header(), chunk_bytes))
    chunks[0].header.CopyFrom(header)
    return chunks


printable = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
# Strings no identifier may be: control characters (forged log lines) or longer than the limit.
bad_ids = st.one_of(
    st.text(min_size=1, max_size=20).filter(lambda t: any(ord(c) < 0x20 or ord(c) == 0x7F for c in t)),
    st.integers(MAX_ID_CHARS + 1, 100_000).map(lambda n: "x" * n),
)
header_faults = st.one_of(
    printable.filter(lambda t: t != FP).map(lambda t: (dict(fingerprint=t), C.FAILED_PRECONDITION)),
    bad_ids.map(lambda t: (dict(fingerprint=t), C.INVALID_ARGUMENT)),
    st.integers(2, 2**32 - 1).map(lambda r: (dict(rank=r, trainer_id=f"t{r}"), C.NOT_FOUND)),
    printable.filter(lambda t: t != "t1").map(lambda t: (dict(trainer_id=t), C.ALREADY_EXISTS)),
    bad_ids.map(lambda t: (dict(trainer_id=t), C.INVALID_ARGUMENT)),
    st.integers(1, 2**63).map(lambda v: (dict(version=v), C.OUT_OF_RANGE)),
    st.just((dict(num_samples=0), C.INVALID_ARGUMENT)),
)


PUSH_RPCS = st.sampled_from(["Push", "PushPull"])


def send_push(shard, chunks, rpc):
    """A gradient stream through Push, or through PushPull (same checks; the reply is the weights)."""
    if rpc == "Push":
        return shard.push_chunks(chunks)
    return list(shard.stub.PushPull(iter(chunks), timeout=5))


@SETTINGS
@given(fault=header_faults, rpc=PUSH_RPCS)
def test_push_with_a_broken_header_field(shard, fault, rpc):
    overrides, code = fault
    expect(shard, lambda: send_push(shard, chunks_for(good_header(**overrides)), rpc), code)


@SETTINGS
@given(dtype=st.integers(0, 2**31 - 1).filter(lambda d: d != pb.FLOAT32),
       length=st.integers(0, 2**40))
def test_push_with_a_wrong_dtype_or_length(shard, dtype, length):
    expect(shard, lambda: shard.push_chunks(chunks_for(good_header(dtype=dtype))), C.INVALID_ARGUMENT)
    if length != P:
        code = C.RESOURCE_EXHAUSTED if length * 4 > MAX_PUSH else C.INVALID_ARGUMENT
        expect(shard, lambda: shard.push_chunks(chunks_for(good_header(length=length))), code)


@SETTINGS
@given(data=st.data(), rpc=PUSH_RPCS)
def test_push_with_broken_chunk_tiling(shard, data, rpc):
    chunks = chunks_for(good_header(), chunk_bytes=data.draw(st.sampled_from([64, 400, 1000])))
    kind = data.draw(st.sampled_from(["drop", "duplicate", "swap", "offset", "odd bytes", "no header", "extra header"]))
    i = data.draw(st.integers(1, len(chunks) - 1))
    if kind == "drop":
        del chunks[i]
    elif kind == "duplicate":
        chunks.insert(i, chunks[i])
    elif kind == "swap":
        chunks[i - 1], chunks[i] = chunks[i], chunks[i - 1]
        if i - 1 == 0:
            chunks[0].header.CopyFrom(chunks[1].header)
            chunks[1].ClearField("header")
    elif kind == "offset":
        chunks[i].offset = data.draw(st.integers(0, 2**63).filter(lambda o: o != chunks[i].offset))
    elif kind == "odd bytes":
        chunks[i].data = chunks[i].data[: data.draw(st.integers(0, len(chunks[i].data) - 1))] + b"\x01"
        chunks[i].data = chunks[i].data[: len(chunks[i].data) - (len(chunks[i].data) % 4 == 0)]
    elif kind == "no header":
        chunks = chunks[1:]
    else:
        chunks[i].header.CopyFrom(chunks[0].header)
    expect(shard, lambda: send_push(shard, chunks, rpc), C.INVALID_ARGUMENT)


@SETTINGS
@given(index=st.integers(0, P - 1), bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]), rpc=PUSH_RPCS)
def test_push_with_a_non_finite_value(shard, index, bad, rpc):
    values = torch.ones(P)
    values[index] = bad
    expect(shard, lambda: send_push(shard, chunks_for(good_header(), values), rpc), C.INVALID_ARGUMENT)


@SETTINGS
@given(fault=header_faults.filter(lambda f: "version" not in f[0] and "num_samples" not in f[0]))
def test_init_leave_heartbeat_pull_with_a_broken_identity(shard, fault):
    overrides, code = fault
    h = good_header(**overrides)
    expect(shard, lambda: shard.stub.Init(iter(chunks_for(h)), timeout=5), code)
    expect(shard, lambda: shard.stub.Leave(pb.LeaveRequest(rank=h.rank, trainer_id=h.trainer_id,
                                                           fingerprint=h.fingerprint), timeout=5), code)
    expect(shard, lambda: shard.stub.Heartbeat(pb.HeartbeatRequest(rank=h.rank, trainer_id=h.trainer_id,
                                                                   fingerprint=h.fingerprint), timeout=5), code)
    expect(shard, lambda: list(shard.stub.Pull(pb.PullRequest(rank=h.rank, trainer_id=h.trainer_id,
                                                              fingerprint=h.fingerprint), timeout=5)), code)


@SETTINGS
@given(dtype=st.integers(2, 2**31 - 1).filter(lambda d: d != pb.FLOAT32))
def test_pull_with_an_unknown_dtype(shard, dtype):
    expect(shard, lambda: list(shard.stub.Pull(pb.PullRequest(rank=1, trainer_id="t1", fingerprint=FP,
                                                              dtype=dtype), timeout=5)), C.INVALID_ARGUMENT)


mode_strategy = st.one_of(st.text(max_size=12).filter(lambda m: m not in ("sync", "async", "stale-timeout")))


@SETTINGS
@given(data=st.data())
def test_register_with_a_broken_field(shard, data):
    job = make_spec(num_trainers=2).to_proto()
    kind = data.draw(st.sampled_from(["shard", "rank", "mode", "trainers", "optimizer", "lr", "staleness",
                                      "tensor", "policy"]))
    rank, expected_shard, code = 1, 0, C.FAILED_PRECONDITION
    if kind == "shard":
        expected_shard = data.draw(st.integers(1, 2**32 - 1))
    elif kind == "rank":
        rank, code = data.draw(st.integers(2, 2**32 - 1)), C.INVALID_ARGUMENT
    elif kind == "mode":
        job.mode, code = data.draw(mode_strategy), C.INVALID_ARGUMENT
    elif kind == "trainers":
        job.num_trainers = data.draw(st.integers(3, 2**32 - 1))  # different from the job's 2; over the cap: invalid
        code = C.FAILED_PRECONDITION if job.num_trainers <= MAX_TRAINERS else C.INVALID_ARGUMENT
    elif kind == "optimizer":
        job.optimizer.name, code = data.draw(st.text(max_size=8).filter(lambda n: n not in ("sgd", "adam", "adamw"))), \
            C.INVALID_ARGUMENT
    elif kind == "lr":
        job.optimizer.lr = data.draw(st.floats(-10, 10).filter(lambda x: x != job.optimizer.lr))
        code = C.INVALID_ARGUMENT if not job.optimizer.lr > 0 else C.FAILED_PRECONDITION
    elif kind == "staleness":
        job.max_staleness, code = data.draw(st.integers(-2**62, -2)), C.INVALID_ARGUMENT
    elif kind == "tensor":  # a consistent spec of another size is another job; past the cap it is invalid
        job.tensors[0].shape[0] = job.total_params = data.draw(st.integers(0, 2**40).filter(lambda n: n != P))
        code = C.FAILED_PRECONDITION if job.total_params <= MAX_TOTAL_PARAMS else C.INVALID_ARGUMENT
    else:
        job.stale_policy, code = data.draw(st.text(max_size=6).filter(lambda p: p not in ("drop", "scale"))), \
            C.INVALID_ARGUMENT
    req = pb.RegisterRequest(rank=rank, trainer_id="t1", expected_shard=expected_shard, job=job)
    expect(shard, lambda: shard.stub.Register(req, timeout=5), code)
