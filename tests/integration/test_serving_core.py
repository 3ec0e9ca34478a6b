"""The grpc.aio serving core, exercised over real gRPC on 127.0.0.1.

What the rewrite onto grpc.aio promises (psserver/serving/server.py, service.py, runtime.py):
a waiting trainer is an awaited future, not a parked thread; Health and Heartbeat
are answered while anything else waits or stalls; an abandoned call keeps nothing;
one connection cannot hold more than its share; and every declared value is bounded
before it touches state.  Each refusal is checked for its status code, a message
naming the field and values, an unchanged state hash, and a shard that still serves
a legitimate trainer afterwards.

Where a test must know that the shard has reached a state it cannot be told about
(N pulls parked on the shard), it polls that state with tests/helpers.py's ``wait_until``:
a bounded check of a condition, which fails naming the condition; never a sleep standing
in for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.protocol import stubs
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import OptimizerConfig
from psserver.protocol.limits import MAX_ID_CHARS, MAX_SEQUENCE, MAX_SYNC_TIMEOUT, MAX_TRAINERS, MIN_CHUNK_BYTES
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.serving.server import ServerConfig, ShardServer
from psserver.serving.service import ServiceLimits
from psserver.sparse.serving import Tables
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until

C = grpc.StatusCode
FP = "f" * 16
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---------------------------------------------------------------------------------------------- helpers
def own_channel(address: str) -> grpc.Channel:
    """A channel on a TCP connection of its own.  By default gRPC shares one connection between channels
    to the same address, and the shard's per-connection limit counts calls per connection."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def health(channel: grpc.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def on_shard_loop(shard, fn):
    """``fn()`` evaluated on the shard's event loop (where the runtime's tables change), from the test thread."""
    async def run():
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), shard.server.runtime.loop).result(10)


def waiting_pulls(shard) -> int:
    return on_shard_loop(shard, lambda: len(shard.server.runtime.waiters(0)))


def pull_request(rank=0, min_version=0, dtype=pb.FLOAT32, trainer_id=None, fingerprint=FP) -> pb.PullRequest:
    return pb.PullRequest(rank=rank, trainer_id=trainer_id or f"t{rank}", fingerprint=fingerprint,
                          min_version=min_version, dtype=dtype)


def gradient_chunks(shard, grad, chunk_bytes=1024, **header) -> list:
    h = shard.header(n=header.pop("n", grad.numel()), **header)
    return list(encode(wire_tensor(grad, h.dtype), h, chunk_bytes))


def weights_of(chunks) -> tuple[pb.ChunkHeader, torch.Tensor]:
    data = b"".join(c.data for c in chunks)
    return chunks[0].header, torch.frombuffer(bytearray(data), dtype=torch.float32)


def sgd_reference(initial: torch.Tensor, grad: torch.Tensor, lr=0.5, momentum=0.9) -> torch.Tensor:
    """One torch.optim.SGD step of make_spec()'s optimizer: what a shard's first round must produce."""
    p = torch.nn.Parameter(initial.clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum)
    p.grad = grad.clone()
    opt.step()
    return p.detach()


def stalled_stream(release: threading.Event):
    """A request iterator that yields nothing until ``release`` is set, then ends (a stalled client)."""
    release.wait(300)  # the test sets it in a finally; the bound only guards against a test bug
    return
    yield  # noqa: unreachable -- makes this a generator


def initialised(shard_server, num_trainers=1, seed=1, **cfg):
    """A sync shard of ``num_trainers`` (all registered), initialised by rank 0; leases off unless asked."""
    cfg.setdefault("lease_timeout", 0)
    shard = shard_server(**cfg)
    spec = make_spec(num_trainers=num_trainers)
    for rank in range(num_trainers):
        shard.register(rank=rank, spec=spec)
    initial = torch.randn(P, generator=torch.Generator().manual_seed(seed))
    assert shard.init(initial).accepted
    return shard, initial


# ---------------------------------------------------------------------------------------------- 1. waits hold no thread
def test_two_hundred_waiting_trainers_hold_no_thread_and_health_answers_while_they_wait(shard_server):
    n = 200
    # All the waits go over one client connection here: the per-connection limit is raised to let them.
    shard, initial = initialised(shard_server, num_trainers=n,
                                 limits=ServiceLimits(min_chunk_bytes=256, max_calls_per_peer=n + 8))
    grads = [torch.full((P,), float(rank % 7) - 3.0) + torch.linspace(0, 1, P) for rank in range(n)]

    async def scenario():
        async with grpc.aio.insecure_channel(shard.server.address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            health_stub = health_pb2_grpc.HealthStub(channel)
            await channel.channel_ready()

            async def push_pull(rank):
                call = stub.PushPull(gradient_chunks(shard, grads[rank], rank=rank), timeout=120)
                return [c async for c in call]

            threads_before = threading.active_count()
            waiting = [asyncio.ensure_future(push_pull(rank)) for rank in range(n - 1)]
            try:
                deadline = time.monotonic() + 120
                while waiting_pulls(shard) < n - 1:  # bounded poll of the shard's state (see wait_until)
                    assert time.monotonic() < deadline, f"{waiting_pulls(shard)} of {n - 1} pushes are waiting"
                    done = [t for t in waiting if t.done()]
                    assert not done, f"a push ended before its round closed: {done[0].exception()!r}"
                    await asyncio.sleep(0.005)
                threads_while_waiting = threading.active_count()
                # while 199 trainers wait: health and heartbeat answer, the round is still open
                for service in ("", "psgrpc.v1.ParameterServer"):
                    reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                    assert reply.status == SERVING
                beat = await stub.Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id="t0", fingerprint=FP), timeout=10)
                assert beat.version == 0 and beat.live == n
                stats = await stub.GetStats(pb.StatsRequest(), timeout=10)
                assert stats.version == 0 and stats.counters["pushes_applied"] == n - 1
                assert not any(t.done() for t in waiting)
                last = await push_pull(n - 1)  # the 200th push closes the round
                replies = await asyncio.wait_for(asyncio.gather(*waiting), 120)
            finally:
                for t in waiting:
                    t.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)
            return threads_before, threads_while_waiting, replies + [last]

    threads_before, threads_while_waiting, replies = asyncio.run(scenario())
    # the server's threads are a fixed set (loop, state worker, gRPC's own); none per waiting call
    assert threads_while_waiting - threads_before <= 4, (threads_before, threads_while_waiting)
    assert len(replies) == n
    headers = [weights_of(r)[0] for r in replies]
    assert all(h.version == 1 for h in headers)
    assert [h.outcome for h in headers] == [pb.ACCEPTED] * (n - 1) + [pb.APPLIED]
    expected = sgd_reference(initial, torch.stack(grads).mean(0))
    for r in replies:
        assert torch.allclose(weights_of(r)[1], expected, atol=1e-5)
    stats = shard.stats()
    assert stats.version == 1 and stats.counters["rounds_all_arrived"] == 1 and waiting_pulls(shard) == 0


# ---------------------------------------------------------------------------------------------- 2. stalled streams
STALLED = 64


def probe_stranger(stub) -> grpc.StatusCode:
    """A data call from the stranger's connection: FAILED_PRECONDITION (no job, or not its job) once it gets
    a slot, RESOURCE_EXHAUSTED while the connection's slots are all held.  It holds its slot for no await."""
    try:
        list(stub.Pull(pull_request(rank=0, trainer_id="stranger", fingerprint="0" * 16), timeout=10))
    except grpc.RpcError as e:
        return e.code()
    return C.OK


@contextlib.contextmanager
def stalled_streams(address: str):
    """A stranger's connection holding STALLED Push streams that never send a chunk until ``release`` is set;
    whatever happens, they are released and cancelled and the connection closed."""
    stranger = own_channel(address)
    release = threading.Event()
    calls = []
    try:
        stub = pb_grpc.ParameterServerStub(stranger)
        calls = [stub.Push.future(stalled_stream(release), timeout=120) for _ in range(STALLED)]
        yield stranger, stub, release, calls
    finally:
        release.set()
        for c in calls:
            c.cancel()
        stranger.close()


def test_stalled_streams_from_a_stranger_leave_health_and_a_real_job_served(shard_server):
    # Idle deadline far away: the streams stay held for the whole test.
    shard = shard_server(lease_timeout=0, limits=ServiceLimits(min_chunk_bytes=256, stream_idle_timeout=600))
    with stalled_streams(shard.server.address) as (stranger, stub, release, calls):
        # the shard holds all 64: the stranger's connection has no slot left (default limit 64)
        wait_until(lambda: probe_stranger(stub) == C.RESOURCE_EXHAUSTED, "the shard to hold the 64 stalled streams")
        with own_channel(shard.server.address) as prober:
            assert health(prober) == SERVING
            assert health(prober, "psgrpc.v1.ParameterServer") == SERVING
        assert health(stranger) == SERVING  # health is no data call: not limited per connection
        # a legitimate single-trainer job registers, initialises and completes a step meanwhile
        assert shard.register().initialized is False
        initial = torch.randn(P, generator=torch.Generator().manual_seed(2))
        assert shard.init(initial).accepted
        header, weights = shard.push_pull(torch.ones(P), sequence=1)
        assert header.outcome == pb.APPLIED and header.version == 1
        assert torch.allclose(weights, sgd_reference(initial, torch.ones(P)))
        assert not any(c.done() for c in calls), "the stalled streams are still held"
        assert probe_stranger(stub) == C.RESOURCE_EXHAUSTED
        release.set()  # the stranger's streams end without a chunk: refused as empty
        for c in calls:
            err = c.exception(timeout=60)
            assert err is not None and err.code() == C.INVALID_ARGUMENT, err
            assert "the stream is empty" in err.details()
        assert probe_stranger(stub) == C.FAILED_PRECONDITION  # its slots are free again
    assert shard.stats().counters["pushes_applied"] == 1


def test_stalled_streams_are_ended_by_the_idle_deadline(shard_server):
    shard = shard_server(lease_timeout=0, limits=ServiceLimits(min_chunk_bytes=256, stream_idle_timeout=1.0))
    with stalled_streams(shard.server.address) as (_, stub, _, calls):
        errors = [c.exception(timeout=120) for c in calls]  # the shard ends them; the client never does
        for err in errors:
            assert err is not None and err.code() == C.DEADLINE_EXCEEDED, err
            assert "no chunk arrived for 1.0 s" in err.details() and "--stream-idle-timeout" in err.details()
        assert probe_stranger(stub) == C.FAILED_PRECONDITION  # nothing of the stranger's is held any more
    assert shard.stats().counters["refused_DEADLINE_EXCEEDED"] == STALLED
    with own_channel(shard.server.address) as prober:
        assert health(prober) == SERVING
    shard.register()
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P), chunk_bytes=4000).outcome == pb.APPLIED


# ---------------------------------------------------------------------------------------------- 3. abandoned calls
@pytest.mark.parametrize("rpc", ["Pull", "PushPull"])
def test_a_call_abandoned_while_waiting_keeps_nothing_on_the_shard(shard_server, rpc):
    # One data call per connection: the follow-up on the same connection only gets in if the
    # abandoned call's slot was given back.
    shard, initial = initialised(shard_server, num_trainers=2,
                                 limits=ServiceLimits(min_chunk_bytes=256, max_calls_per_peer=1))
    if rpc == "Pull":
        call = shard.stub.Pull(pull_request(rank=0, min_version=1), timeout=120)
    else:
        call = shard.stub.PushPull(iter(gradient_chunks(shard, torch.ones(P), rank=0)), timeout=120)
    try:
        wait_until(lambda: waiting_pulls(shard) == 1, f"the pull to wait in the {rpc}")
        call.cancel()
    finally:
        call.cancel()
    refused(lambda: list(call), C.CANCELLED)
    wait_until(lambda: waiting_pulls(shard) == 0, "the shard to forget the abandoned wait")
    assert shard.stats().counters["pulls"] == 0  # no snapshot was taken for it
    # the shard still serves, on the same connection: rank 1's push closes the round
    grad1 = torch.full((P,), 3.0)
    reply = shard.push(grad1, rank=1)
    if rpc == "PushPull":  # rank 0's gradient was accepted before the call was abandoned: it stays in the round
        assert reply.outcome == pb.APPLIED and reply.version == 1
    else:
        assert reply.outcome == pb.ACCEPTED
        assert shard.push(torch.ones(P), rank=0).outcome == pb.APPLIED
    version, weights = shard.pull(rank=0, min_version=1)
    assert version == 1 and torch.allclose(weights, sgd_reference(initial, (torch.ones(P) + grad1) / 2))


# ---------------------------------------------------------------------------------------------- 4. per-connection limit
FIFTH_CALL = {
    "Pull": lambda stub, shard: list(stub.Pull(pull_request(rank=0), timeout=10)),
    "Push": lambda stub, shard: stub.Push(iter(gradient_chunks(shard, torch.ones(P))), timeout=10),
    "PushPull": lambda stub, shard: list(stub.PushPull(iter(gradient_chunks(shard, torch.ones(P))), timeout=10)),
}


@pytest.mark.parametrize("fifth", list(FIFTH_CALL))
def test_a_fifth_call_on_one_connection_is_refused_while_four_are_in_flight(shard_server, fifth):
    shard, initial = initialised(shard_server, limits=ServiceLimits(min_chunk_bytes=256, max_calls_per_peer=4))
    channel = own_channel(shard.server.address)
    stub = pb_grpc.ParameterServerStub(channel)
    pulls = []
    try:
        pulls = [stub.Pull(pull_request(rank=0, min_version=1), timeout=120) for _ in range(4)]
        wait_until(lambda: waiting_pulls(shard) == 4, "the shard to hold the four pulls")
        before = shard.digest()  # over the fixture's own connection
        refused(lambda: FIFTH_CALL[fifth](stub, shard), C.RESOURCE_EXHAUSTED,
                "already has 4 calls in flight, the limit is 4", "--max-calls-per-peer")
        assert health(channel) == SERVING  # health is answered on the full connection
        assert shard.digest() == before
        counters = shard.stats().counters
        assert counters["refused_over_limit"] == 1 and counters["pushes_applied"] == 0
        # another connection is not limited by this one: the trainer's push closes the round
        assert shard.push(torch.ones(P)).outcome == pb.APPLIED
        for p in pulls:
            header, weights = weights_of(list(p))
            assert header.version == 1 and torch.allclose(weights, sgd_reference(initial, torch.ones(P)))
        # the four ended: calls on the connection succeed again
        header, _ = weights_of(list(stub.Pull(pull_request(rank=0, min_version=1), timeout=10)))
        assert header.version == 1
    finally:
        for p in pulls:
            p.cancel()
        channel.close()


# ---------------------------------------------------------------------------------------------- 5. optimizer settings
OPTIMIZER_CASES = {
    "momentum -1": (dict(momentum=-1.0), "The momentum (-1.0) must be zero or more"),
    "weight_decay -1": (dict(weight_decay=-1.0), "The weight_decay (-1.0) must be zero or more"),
    "adam beta1 2.0": (dict(name="adam", beta1=2.0), "The beta1 (2.0) must be at least 0 and less than 1"),
    "eps -1": (dict(eps=-1.0), "The eps (-1.0) must be zero or more"),
    "lr NaN": (dict(lr=math.nan), "The learning rate (nan) must be a finite number"),
}


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_invalid_optimizer_settings_are_refused_at_register_and_fix_no_job(shard_server, case):
    fields, fragment = OPTIMIZER_CASES[case]
    shard = shard_server(lease_timeout=0)
    job = make_spec().to_proto()
    for name, value in fields.items():
        setattr(job.optimizer, name, value)
    before = shard.digest()
    refused(lambda: shard.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=job), timeout=10),
            C.INVALID_ARGUMENT, "job spec: " + fragment)
    stats = shard.stats(digest=True)
    assert stats.mode == "" and not stats.HasField("job") and stats.state_digest == before
    # the refused spec fixed nothing: a different, valid spec becomes the job, and the shard serves it
    valid = dataclasses.replace(make_spec(), optimizer=OptimizerConfig("adamw", lr=0.01, weight_decay=0.01))
    assert shard.register(spec=valid).initialized is False
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED
    stats = shard.stats(digest=True)
    assert stats.job.optimizer.name == "adamw" and stats.version == 1
    assert re.fullmatch("[0-9a-f]{64}", stats.state_digest)


# ---------------------------------------------------------------------------------------------- 6. caps on declared sizes
HUGE_ID = "x" * (4 << 20)
NEWLINE_ID = "t1\nFORGED shard 0: rank 0 registered"


def _register(job=None, trainer_id="t1", **job_fields):
    def call(shard):
        msg = (job or make_spec(num_trainers=2)).to_proto()
        for name, value in job_fields.items():
            setattr(msg, name, value)
        return shard.stub.Register(pb.RegisterRequest(rank=1, trainer_id=trainer_id, job=msg), timeout=10)

    return call


CAP_CASES = {
    "num_trainers 30,000,000 (Register)": (
        _register(num_trainers=30_000_000), [f"The number of trainers (30000000) must be between 1 and {MAX_TRAINERS}"]),
    "sync_timeout 1e10 (Register)": (
        _register(sync_timeout=1e10), [f"The sync timeout (10000000000.0 s) must be between 0 and {MAX_SYNC_TIMEOUT:.0f}"]),
    "4 MB trainer_id (Register)": (
        _register(trainer_id=HUGE_ID), [f"trainer_id is {len(HUGE_ID)} characters long, over the limit of {MAX_ID_CHARS}"]),
    "4 MB trainer_id (Push header)": (
        lambda s: s.push(torch.ones(P), rank=1, trainer_id=HUGE_ID),
        [f"trainer_id is {len(HUGE_ID)} characters long, over the limit of {MAX_ID_CHARS}"]),
    "trainer_id with a newline (Register)": (
        _register(trainer_id=NEWLINE_ID), ["trainer_id contains a control character at position 2", "'t1\\nFORGED"]),
    "trainer_id with a newline (Heartbeat)": (
        lambda s: s.stub.Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id=NEWLINE_ID, fingerprint=FP), timeout=10),
        ["trainer_id contains a control character at position 2", "'t1\\nFORGED"]),
    "200-character fingerprint (Register)": (
        _register(fingerprint="f" * 200), [f"fingerprint is 200 characters long, over the limit of {MAX_ID_CHARS}"]),
    "200-character fingerprint (Pull)": (
        lambda s: list(s.stub.Pull(pull_request(rank=0, fingerprint="f" * 200), timeout=10)),
        [f"fingerprint is 200 characters long, over the limit of {MAX_ID_CHARS}"]),
}


@pytest.mark.parametrize("case", list(CAP_CASES))
def test_declared_sizes_over_their_caps_are_refused_and_never_logged_raw(shard_server, caplog, case):
    call, fragments = CAP_CASES[case]
    caplog.set_level(logging.INFO)
    shard = shard_server(lease_timeout=0)
    spec = make_spec(num_trainers=2)
    shard.register(rank=0, spec=spec)
    initial = torch.randn(P, generator=torch.Generator().manual_seed(3))
    shard.init(initial)
    assert shard.push(torch.ones(P), rank=0).outcome == pb.ACCEPTED  # an open round is part of the hashed state
    before = shard.digest()
    err = refused(lambda: call(shard), C.INVALID_ARGUMENT, *fragments)
    assert shard.digest() == before
    assert "\n" not in err.details() and len(err.details()) < 1000
    messages = [r.getMessage() for r in caplog.records]
    assert any("refused with INVALID_ARGUMENT" in m for m in messages), messages  # the refusal was logged...
    for m in messages:  # ...shortened and escaped
        assert "x" * (MAX_ID_CHARS + 1) not in m
        assert "\nFORGED" not in m
    # the shard still serves: rank 1 registers and closes the round
    shard.register(rank=1, spec=spec)
    assert shard.push(torch.full((P,), 3.0), rank=1).outcome == pb.APPLIED
    assert torch.allclose(shard.pull(rank=1, min_version=1)[1], sgd_reference(initial, torch.full((P,), 2.0)))


# ---------------------------------------------------------------------------------------------- 7. protocol holes
def test_a_trainer_that_left_is_not_found_until_it_registers_again(shard_server):
    shard, initial = initialised(shard_server, num_trainers=2)
    assert shard.stub.Leave(pb.LeaveRequest(rank=1, trainer_id="t1", fingerprint=FP), timeout=10).remaining == 1
    before = shard.digest()
    refused(lambda: shard.push(torch.full((P,), 5.0), rank=1), C.NOT_FOUND,
            "rank 1 left the job on shard 0: register again to push")
    assert shard.digest() == before  # its gradient is not in the round
    shard.register(rank=1, spec=make_spec(num_trainers=2))
    assert shard.push(torch.full((P,), 3.0), rank=1).outcome == pb.ACCEPTED
    assert shard.push(torch.ones(P), rank=0).outcome == pb.APPLIED
    assert torch.allclose(shard.pull(min_version=1)[1], sgd_reference(initial, torch.full((P,), 2.0)))


def test_init_from_rank_1_is_refused_before_its_payload_is_read(shard_server):
    shard = shard_server(lease_timeout=0)
    spec = make_spec(num_trainers=2)
    shard.register(rank=0, spec=spec)
    shard.register(rank=1, spec=spec)
    before = shard.digest()
    release = threading.Event()

    def header_then_stall():
        # the header, then a payload that never comes: a shard reading the payload would wait for it
        yield gradient_chunks(shard, torch.zeros(P), rank=1)[0]
        release.wait(300)

    try:
        refused(lambda: shard.stub.Init(header_then_stall(), timeout=60), C.FAILED_PRECONDITION,
                "Init came from rank 1, but only rank 0 initialises the shards")
    finally:
        release.set()
    stats = shard.stats(digest=True)
    assert not stats.initialized and stats.state_digest == before
    assert stats.counters["bytes_in"] == 0  # not a byte of the payload was counted
    x = torch.randn(P, generator=torch.Generator().manual_seed(4))
    assert shard.init(x, rank=0).accepted
    assert torch.equal(shard.pull(rank=1)[1], x)


def test_a_sequence_over_the_cap_is_refused_and_does_not_poison_the_next_push(shard_server):
    shard, initial = initialised(shard_server)
    before = shard.digest()
    refused(lambda: shard.push(torch.ones(P), sequence=2**64 - 1), C.INVALID_ARGUMENT,
            f"sequence is {2**64 - 1}, over the limit of {MAX_SEQUENCE}")
    assert shard.digest() == before
    reply = shard.push(torch.ones(P), sequence=1)
    assert reply.outcome == pb.APPLIED and reply.version == 1


@pytest.mark.parametrize("rpc", ["Init", "Push", "PushPull", "Pull"])
def test_a_data_call_before_any_register_is_failed_precondition_even_with_dtype_0(shard_server, rpc):
    shard = shard_server(lease_timeout=0)
    before = shard.digest()
    h = shard.header(dtype=pb.DTYPE_UNSPECIFIED)
    chunks = [pb.Chunk(header=h, offset=0, data=bytes(4 * P))]
    calls = {
        "Init": lambda: shard.stub.Init(iter(chunks), timeout=10),
        "Push": lambda: shard.stub.Push(iter(chunks), timeout=10),
        "PushPull": lambda: list(shard.stub.PushPull(iter(chunks), timeout=10)),
        "Pull": lambda: list(shard.stub.Pull(pull_request(dtype=pb.DTYPE_UNSPECIFIED), timeout=10)),
    }
    refused(calls[rpc], C.FAILED_PRECONDITION, "shard 0 has no job yet: register first")
    stats = shard.stats(digest=True)
    assert stats.state_digest == before and stats.mode == "" and not stats.initialized
    shard.register()
    shard.init(torch.zeros(P))
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED


GARBAGE = b"\xff\xff\xff"
UNDECODABLE = {
    "Register": ("unary_unary", "the request could not be decoded"),
    "Leave": ("unary_unary", "the request could not be decoded"),
    "Heartbeat": ("unary_unary", "the request could not be decoded"),
    "GetStats": ("unary_unary", "the request could not be decoded"),
    "Pull": ("unary_stream", "the request could not be decoded"),
    "Init": ("stream_unary", "malformed Chunk message"),
    "Push": ("stream_unary", "malformed Chunk message"),
    "PushPull": ("stream_stream", "malformed Chunk message"),
}


@pytest.mark.parametrize("method", list(UNDECODABLE))
def test_undecodable_bytes_are_invalid_argument_never_internal(shard_server, method):
    kind, fragment = UNDECODABLE[method]
    shard, initial = initialised(shard_server)
    before = shard.digest()
    raw = getattr(shard.channel, kind)(stubs.method(method), request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
    call = {
        "unary_unary": lambda: raw(GARBAGE, timeout=10),
        "unary_stream": lambda: list(raw(GARBAGE, timeout=10)),
        "stream_unary": lambda: raw(iter([GARBAGE]), timeout=10),
        "stream_stream": lambda: list(raw(iter([GARBAGE]), timeout=10)),
    }[kind]
    refused(call, C.INVALID_ARGUMENT, fragment)
    assert shard.digest() == before
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED


def test_finite_gradients_whose_round_sum_overflows_are_refused_and_the_round_survives(shard_server):
    shard, initial = initialised(shard_server, num_trainers=2)
    # 1e37 is finite; weighted by 20 samples each, two of them sum past float32's 3.4e38
    big = torch.full((P,), 1e37)
    assert shard.push(big, rank=0, num_samples=20).outcome == pb.ACCEPTED
    before = shard.digest()
    refused(lambda: shard.push(big, rank=1, num_samples=20), C.INVALID_ARGUMENT, "overflows float32")
    assert shard.digest() == before
    assert shard.stats().counters["refused_overflow"] == 1
    reply = shard.push(torch.ones(P), rank=1, num_samples=20)
    assert reply.outcome == pb.APPLIED and reply.version == 1
    version, weights = shard.pull(min_version=1)
    assert version == 1 and bool(torch.isfinite(weights).all())
    assert torch.allclose(weights, sgd_reference(initial, (big.double() + 1).div(2).float()), rtol=1e-5)


def test_tiny_or_empty_chunks_are_refused_under_the_default_minimum(shard_server):
    shard = shard_server(lease_timeout=0, limits=ServiceLimits())  # the default minimum chunk size
    assert ServiceLimits().min_chunk_bytes == MIN_CHUNK_BYTES
    shard.register()
    before = shard.digest()
    # Init cut into 4-byte chunks: refused at its first chunk, the shard stays uninitialised
    refused(lambda: shard.stub.Init(iter(gradient_chunks(shard, torch.zeros(P), chunk_bytes=4)), timeout=10),
            C.INVALID_ARGUMENT, f"the chunk at offset 0 carries 4 bytes, under the minimum of {MIN_CHUNK_BYTES}")
    assert not shard.stats().initialized and shard.digest() == before
    initial = torch.randn(P, generator=torch.Generator().manual_seed(5))
    assert shard.stub.Init(iter(gradient_chunks(shard, initial, chunk_bytes=1 << 20)), timeout=10).accepted
    before = shard.digest()
    refused(lambda: shard.push(torch.ones(P), chunk_bytes=4), C.INVALID_ARGUMENT,
            f"the chunk at offset 0 carries 4 bytes, under the minimum of {MIN_CHUNK_BYTES}")
    assert shard.digest() == before
    # a stream of a million empty chunks is refused at the first: the client is not read to the end
    offered = 1_000_000
    sent = [0]

    def empty_chunks():
        h = shard.header()
        for i in range(offered):
            sent[0] += 1
            yield pb.Chunk(header=h, offset=0) if i == 0 else pb.Chunk(offset=0)

    refused(lambda: shard.stub.Push(empty_chunks(), timeout=60), C.INVALID_ARGUMENT,
            f"the chunk at offset 0 carries 0 bytes, under the minimum of {MIN_CHUNK_BYTES}")
    assert sent[0] < offered
    assert shard.digest() == before
    assert shard.push(torch.ones(P), chunk_bytes=1 << 20).outcome == pb.APPLIED
    assert torch.allclose(shard.pull(min_version=1)[1], sgd_reference(initial, torch.ones(P)))


# ---------------------------------------------------------------------------------------------- 8. job lifecycle
def test_after_every_trainer_left_a_register_starts_a_new_job_from_scratch(shard_server):
    shard = shard_server(lease_timeout=0, limits=ServiceLimits(min_chunk_bytes=256, max_pull_wait=0.5))
    spec = make_spec(num_trainers=2)
    shard.register(rank=0, spec=spec)
    shard.register(rank=1, spec=spec)
    shard.init(torch.randn(P, generator=torch.Generator().manual_seed(6)))
    assert shard.push(torch.ones(P), rank=0).outcome == pb.ACCEPTED
    assert shard.push(torch.ones(P), rank=1).outcome == pb.APPLIED
    for rank in (0, 1):
        shard.stub.Leave(pb.LeaveRequest(rank=rank, trainer_id=f"t{rank}", fingerprint=FP), timeout=10)
    assert shard.stats().version == 1
    # the new job: rank 1 first
    reply = shard.register(rank=1, spec=spec)
    assert not reply.initialized and reply.version == 0 and reply.registered == 1
    stats = shard.stats()
    assert not stats.initialized and stats.version == 0 and stats.counters["jobs_ended"] == 1
    refused(lambda: shard.pull(rank=1, timeout=60), C.DEADLINE_EXCEEDED,
            "shard 0 was not initialised within 0.5 s: is rank 0 running?")
    shard.register(rank=0, spec=spec)
    stats = shard.stats()
    assert not stats.initialized and stats.version == 0
    fresh = torch.randn(P, generator=torch.Generator().manual_seed(7))
    reply = shard.init(fresh)
    assert reply.accepted and reply.version == 0
    version, weights = shard.pull(rank=1)
    assert version == 0 and torch.equal(weights, fresh)
    # a fresh optimizer too: the first round's step has no momentum from the old job
    assert shard.push(torch.ones(P), rank=0).outcome == pb.ACCEPTED
    assert shard.push(torch.full((P,), 3.0), rank=1).outcome == pb.APPLIED
    assert torch.allclose(shard.pull(rank=1, min_version=1)[1], sgd_reference(fresh, torch.full((P,), 2.0)))


def test_a_trainer_of_another_job_id_is_refused_while_a_job_runs(shard_server):
    shard = shard_server(lease_timeout=0)
    job_a = make_spec(num_trainers=2, job_id="a")
    shard.register(rank=0, spec=job_a)
    shard.init(torch.zeros(P))
    before = shard.digest()
    refused(lambda: shard.register(rank=1, spec=make_spec(num_trainers=2, job_id="b")), C.FAILED_PRECONDITION,
            "job_id is 'b' but the job has 'a'")
    stats = shard.stats(digest=True)
    assert stats.state_digest == before and stats.job.job_id == "a" and list(stats.live_ranks) == [0]
    shard.register(rank=1, spec=job_a)
    assert shard.push(torch.ones(P), rank=0).outcome == pb.ACCEPTED
    assert shard.push(torch.ones(P), rank=1).outcome == pb.APPLIED


# ---------------------------------------------------------------------------------------------- 9. digest on request
def test_stats_carry_the_state_digest_only_when_asked(shard_server):
    shard, _ = initialised(shard_server)
    plain = shard.stub.GetStats(pb.StatsRequest(), timeout=10)
    assert plain.state_digest == "" and plain.initialized
    first = shard.digest()
    assert re.fullmatch("[0-9a-f]{64}", first)
    assert shard.digest() == first  # a read changes nothing
    shard.push(torch.ones(P))
    assert re.fullmatch("[0-9a-f]{64}", shard.digest()) and shard.digest() != first
    assert shard.stub.GetStats(pb.StatsRequest(with_digest=False), timeout=10).state_digest == ""


def test_heartbeats_stats_and_health_answer_while_a_digest_is_being_hashed(shard_server, monkeypatch):
    """A small slice runs its state work on the loop; a digest of big tables must not: the tables' hash is held
    at a gate until the other calls have answered (on the loop it would hold them all, and they time out)."""
    shard, _ = initialised(shard_server)
    hashing, release = threading.Event(), threading.Event()
    table_digest = Tables.digest

    def gated(tables):
        hashing.set()
        release.wait(60)  # set in the finally below; the bound only guards against a test bug
        return table_digest(tables)

    monkeypatch.setattr(Tables, "digest", gated)
    digest = shard.stub.GetStats.future(
        pb.StatsRequest(with_digest=True, rank=0, trainer_id="t0", fingerprint=FP), timeout=120)
    try:
        assert hashing.wait(30), "the digest never started"
        beat = shard.stub.Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id="t0", fingerprint=FP), timeout=10)
        assert beat.live == 1
        assert shard.stub.GetStats(pb.StatsRequest(), timeout=10).initialized
        assert health(shard.channel) == health_pb2.HealthCheckResponse.SERVING
        assert not digest.done()  # all of it answered while the digest was still being hashed
    finally:
        release.set()
    assert re.fullmatch("[0-9a-f]{64}", digest.result().state_digest)


STRANGERS = {
    "no identity": {},
    "unregistered rank": dict(rank=3, trainer_id="t3", fingerprint=FP),
    "another trainer id": dict(rank=0, trainer_id="intruder", fingerprint=FP),
    "another fingerprint": dict(rank=0, trainer_id="t0", fingerprint="0" * 16),
}


@pytest.mark.parametrize("who", list(STRANGERS))
def test_a_digest_is_refused_to_a_stranger_with_permission_denied_and_changes_nothing(shard_server, who):
    shard, _ = initialised(shard_server)
    before = shard.digest()
    refused(lambda: shard.stub.GetStats(pb.StatsRequest(with_digest=True, **STRANGERS[who]), timeout=10),
            C.PERMISSION_DENIED, "with_digest is set but rank", "is not a member of the job")
    assert shard.stub.GetStats(pb.StatsRequest(**STRANGERS[who]), timeout=10).initialized  # counters: anyone
    assert shard.digest() == before
    assert shard.stats().counters["refused_PERMISSION_DENIED"] == 1
    assert shard.push(torch.ones(P)).outcome == pb.APPLIED  # still serving


# ---------------------------------------------------------------------------------------------- 10. closed by a leave
def test_a_round_closed_by_a_leave_is_counted_as_membership(shard_server):
    shard, initial = initialised(shard_server, num_trainers=2)
    assert shard.push(torch.full((P,), 2.0), rank=0).outcome == pb.ACCEPTED
    assert shard.stats().version == 0
    assert shard.stub.Leave(pb.LeaveRequest(rank=1, trainer_id="t1", fingerprint=FP), timeout=10).remaining == 1
    assert shard.stats().version == 1  # closed by the Leave itself, before it answered
    version, weights = shard.pull(rank=0, min_version=1)
    assert version == 1 and torch.allclose(weights, sgd_reference(initial, torch.full((P,), 2.0)))
    counters = shard.stats().counters
    assert counters["rounds_membership"] == 1 and counters["rounds_all_arrived"] == 0


def test_health_port_answers_beside_the_main_port_and_goes_away_with_the_shard():
    server = ShardServer(ServerConfig(shard=0, host="127.0.0.1", port=0, health_port=0)).start()
    try:
        assert server.health_port not in (-1, 0, server.port)
        for port in (server.port, server.health_port):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert reply.status == SERVING
    finally:
        server.stop(grace=0)
    assert not server.probe_port._proc.is_alive()  # the probe process went with the shard
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert reply.status == NOT_SERVING
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
