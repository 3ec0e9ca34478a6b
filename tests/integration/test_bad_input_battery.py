"""Property-based bad input for every RPC: the documented status, and the shard's state hash unchanged.

Each generated request is a valid one with one field broken in a generated way,
so the expected status follows from which field was broken (docs/status-codes.md).
"""

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.limits import MAX_ID_CHARS, MAX_TOTAL_PARAMS, MAX_TRAINERS
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import OPEN_ROUND_MAX_PUSH as MAX_PUSH
from tests.conftest import P, make_spec
from tests.helpers import refused

FP = "f" * 16
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
C = grpc.StatusCode


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
def test_push_with_a_broken_header_field(open_round_shard, fault, rpc):
    overrides, code = fault
    chunks = chunks_for(good_header(**overrides))
    refused(lambda: send_push(open_round_shard, chunks, rpc), code, unchanged=open_round_shard)


@SETTINGS
@given(dtype=st.integers(0, 2**31 - 1).filter(lambda d: d != pb.FLOAT32),
       length=st.integers(0, 2**40))
def test_push_with_a_wrong_dtype_or_length(open_round_shard, dtype, length):
    wrong_dtype = chunks_for(good_header(dtype=dtype))
    refused(lambda: open_round_shard.push_chunks(wrong_dtype), C.INVALID_ARGUMENT, unchanged=open_round_shard)
    if length != P:
        code = C.RESOURCE_EXHAUSTED if length * 4 > MAX_PUSH else C.INVALID_ARGUMENT
        wrong_length = chunks_for(good_header(length=length))
        refused(lambda: open_round_shard.push_chunks(wrong_length), code, unchanged=open_round_shard)


@SETTINGS
@given(data=st.data(), rpc=PUSH_RPCS)
def test_push_with_broken_chunk_tiling(open_round_shard, data, rpc):
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
    refused(lambda: send_push(open_round_shard, chunks, rpc), C.INVALID_ARGUMENT, unchanged=open_round_shard)


@SETTINGS
@given(index=st.integers(0, P - 1), bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]), rpc=PUSH_RPCS)
def test_push_with_a_non_finite_value(open_round_shard, index, bad, rpc):
    values = torch.ones(P)
    values[index] = bad
    chunks = chunks_for(good_header(), values)
    refused(lambda: send_push(open_round_shard, chunks, rpc), C.INVALID_ARGUMENT, unchanged=open_round_shard)


@SETTINGS
@given(fault=header_faults.filter(lambda f: "version" not in f[0] and "num_samples" not in f[0]))
def test_init_leave_heartbeat_pull_with_a_broken_identity(open_round_shard, fault):
    overrides, code = fault
    h, stub = good_header(**overrides), open_round_shard.stub
    who = dict(rank=h.rank, trainer_id=h.trainer_id, fingerprint=h.fingerprint)
    refused(lambda: stub.Init(iter(chunks_for(h)), timeout=5), code, unchanged=open_round_shard)
    refused(lambda: stub.Leave(pb.LeaveRequest(**who), timeout=5), code, unchanged=open_round_shard)
    refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(**who), timeout=5), code, unchanged=open_round_shard)
    refused(lambda: list(stub.Pull(pb.PullRequest(**who), timeout=5)), code, unchanged=open_round_shard)


@SETTINGS
@given(dtype=st.integers(2, 2**31 - 1).filter(lambda d: d != pb.FLOAT32))
def test_pull_with_an_unknown_dtype(open_round_shard, dtype):
    request = pb.PullRequest(rank=1, trainer_id="t1", fingerprint=FP, dtype=dtype)
    refused(lambda: list(open_round_shard.stub.Pull(request, timeout=5)), C.INVALID_ARGUMENT,
            unchanged=open_round_shard)


mode_strategy = st.one_of(st.text(max_size=12).filter(lambda m: m not in ("sync", "async", "stale-timeout")))


@SETTINGS
@given(data=st.data())
def test_register_with_a_broken_field(open_round_shard, data):
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
    refused(lambda: open_round_shard.stub.Register(req, timeout=5), code, unchanged=open_round_shard)
