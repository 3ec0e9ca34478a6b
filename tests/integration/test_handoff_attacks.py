"""An attacker's pass on a live re-shard's RPCs (docs/design/attacks-2026-11-24.md): Reshard and Handoff from a peer on
another host, plans past the caps, Handoff payloads of the wrong shape or size, streams left open or too big,
and a PREPARE whose copies do not fit in --max-memory.  Real shards over gRPC; each refusal has its one status,
a message naming the field and both values, the shard's state (digest and hand-off records) unchanged, and the
shard still serving."""

import dataclasses
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.layout import Layout
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.security import ClientSecurity, ServerSecurity
from psserver.resharding.handoff.plan import plan_of
from psserver.resharding.handoff.wire import chunks
from psserver.serving.server import ServerConfig, ShardServer
from psserver.serving.service import ServiceLimits
from psserver.serving.service_common import _is_loopback
from psserver.state.budget import dense_bytes
from tests.conftest import P, RawShard
from tests.helpers import refused, wait_until
from tests.integration.test_handoff_io import OLD, Job, Op, _Shard, still_serves

COPY, FORWARD, VOTE = pb.HandoffChunk.COPY, pb.HandoffChunk.FORWARD, pb.HandoffChunk.VOTE
JOB_HEX = OLD.to_proto().SerializeToString().hex()


def _other_job_hex():
    """A job of twice OLD's parameters on two shards: its moves are not OLD's."""
    tensors = (("w", (2000,), "float32"),)
    job = dataclasses.replace(OLD, total_params=2000, tensors=tensors,
                              fingerprint=Layout.from_shapes(tensors, 2).fingerprint())
    return job.to_proto().SerializeToString().hex()


class Shards(Job):
    """``Job`` (two shards running OLD, a third empty) with a ServerConfig of one's own for each shard."""

    def __init__(self, shard_server, **cfg):
        self.shard_server, self.cfg = shard_server, cfg
        super().__init__(self._start)

    def _start(self, shard, **kw):
        return self.shard_server(shard=shard, **{**kw, **self.cfg.get(f"shard{shard}", {})})


def move_to(job, dst):
    """(index, move) of the first move of plan p1 into new shard ``dst``."""
    plan = plan_of(pb.ReshardRequest(plan="p1", old_addresses=job.old, new_addresses=job.new, you=job.new[dst]))
    return next((i, m) for i, m in enumerate(plan.moves(OLD)) if m.dst == dst)


def records(job, i):
    return [(r.plan, r.move, r.phase, r.version) for r in job.reshard(i, Op.STATUS).handoffs]


class _Records:
    """``refused(unchanged=...)`` on shard ``i``: its state digest (if it has a job) and its hand-off records."""

    def __init__(self, job, i):
        self.job, self.i = job, i

    def digest(self):
        digest = self.job.digest(self.i) if self.i < 2 else ""
        return digest, records(self.job, self.i)


def copy_payload(move, **change):
    n = move.b - move.a
    payload = dict(a=move.a, b=move.b, params=torch.zeros(n), job=JOB_HEX,
                   optimizer={"state": {0: {"momentum_buffer": torch.zeros(n)}},
                              "param_groups": [{"lr": 0.5, "momentum": 0.9}]})
    payload.update(change)
    return payload


def test_is_loopback_reads_grpc_peers_of_this_host_and_only_those():
    # (as grpc.aio writes them: a "localhost" client arrives as ipv6:%5B::1%5D:port)
    assert all(_is_loopback(p) for p in ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:43072", "ipv6:[::1]:5000",
                                         "ipv6:%5B::ffff:127.0.0.1%5D:1", "unix:/tmp/s", "ipv4:127.8.9.1:2"))
    assert not any(_is_loopback(p) for p in ("ipv4:192.0.2.2:5000", "ipv6:%5Bfd00::2%5D:41160", "ipv6:[fd00::2]:5",
                                             "", "?", "ipv4:x:1"))


def _this_hosts_address() -> str:
    """An address of this host that is not loopback (the route's source address), or skip: none to call from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: a UDP connect only picks the route
            address = s.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this host has no address beyond loopback to call a shard from")
    return address


def test_reshard_and_handoff_from_another_host_on_a_shard_without_a_token_are_permission_denied():
    """Before: any peer could PREPARE a plan that streams the job's weights to an address of its own, COMMIT a
    round that refuses every push past it, or DECIDE abort the real coordinator's plan (its id is derived from
    the addresses and shown in GetStats)."""
    address = _this_hosts_address()
    server = ShardServer(ServerConfig(shard=0, host="0.0.0.0", port=0, insecure=True, lease_timeout=0)).start()
    try:
        with RawShard(server) as shard:
            shard.channel.close()
            shard.channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")  # a caller on the shard's own host
            shard.stub = pb_grpc.ParameterServerStub(shard.channel)
            _from_another_host(shard, address)
    finally:
        server.stop(grace=0)


def _from_another_host(shard, address):
    shard.register(spec=OLD)
    member = _Shard(_One(shard), 0)
    with grpc.insecure_channel(f"{address}:{shard.server.port}") as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        prepare = pb.ReshardRequest(op=Op.PREPARE, plan="evil", old_addresses=[f"127.0.0.1:{shard.server.port}"],
                                    new_addresses=[f"127.0.0.1:{shard.server.port}", "203.0.113.9:7000"],
                                    you=f"127.0.0.1:{shard.server.port}")
        for op in (Op.PREPARE, Op.PROPOSE, Op.COMMIT, Op.DECIDE, Op.RETIRE):
            prepare.op = op
            refused(lambda: stub.Reshard(prepare, timeout=10), grpc.StatusCode.PERMISSION_DENIED,
                    f"peer is 'ipv4:{address}:", "takes Reshard only from its own host", "--auth-token-file",
                    unchanged=member)
        stream = iter([pb.HandoffChunk(kind=COPY, plan="evil", source="x:1", data=b"x")])
        refused(lambda: stub.Handoff(stream, timeout=10), grpc.StatusCode.PERMISSION_DENIED,
                f"peer is 'ipv4:{address}:", "takes Handoff only from its own host", unchanged=member)
        assert stub.Reshard(pb.ReshardRequest(op=Op.STATUS), timeout=10).handoffs == []  # a read: anyone
    assert shard.stats(fingerprint=OLD.fingerprint).counters["refused_PERMISSION_DENIED"] == 6
    shard.stub.Reshard(pb.ReshardRequest(op=Op.STATUS), timeout=10)  # still serves, from its own host


def test_with_a_token_reshard_from_another_host_needs_the_token_and_is_taken_with_it():
    """The loopback rule is for shards that authenticate no caller: with a token, a coordinator on another host
    holding it re-shards as before, and one without it is UNAUTHENTICATED."""
    address = _this_hosts_address()
    token = "attack2-token"
    server = ShardServer(ServerConfig(shard=0, host="0.0.0.0", port=0, lease_timeout=0,
                                      security=ServerSecurity(token=token))).start()
    try:
        here = f"127.0.0.1:{server.port}"
        plan = pb.ReshardRequest(op=Op.PREPARE, plan="p1", old_addresses=[here], new_addresses=[here, "h:1"],
                                 you=here)
        job = _one_shard_job()
        with ClientSecurity(token=token).channel(here) as local:
            stub = pb_grpc.ParameterServerStub(local)
            stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=0, job=job.to_proto()),
                          timeout=10)
            assert init(stub, job.fingerprint, P).accepted
        with ClientSecurity().channel(f"{address}:{server.port}") as bare:
            refused(lambda: pb_grpc.ParameterServerStub(bare).Reshard(plan, timeout=10),
                    grpc.StatusCode.UNAUTHENTICATED, "token")
        with ClientSecurity(token=token).channel(f"{address}:{server.port}") as remote:
            stub = pb_grpc.ParameterServerStub(remote)
            assert stub.Reshard(plan, timeout=10).plan == "p1"
            plan.op, plan.switch = Op.DECIDE, False
            assert stub.Reshard(plan, timeout=10).layout_epoch == 0  # aborted: the job goes on
    finally:
        server.stop(grace=0)


def init(stub, fingerprint, n):
    h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=fingerprint, dtype=pb.FLOAT32, length=n)
    return stub.Init(encode(wire_tensor(torch.zeros(n), pb.FLOAT32), h, 4 * n), timeout=10)


def _one_shard_job():
    job = dataclasses.replace(OLD, num_shards=1)
    return dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 1).fingerprint())


class _One:
    """``_Shard``'s view of one registered shard."""

    def __init__(self, shard):
        self.shard = shard

    def digest(self, i):
        return self.shard.digest(fingerprint=OLD.fingerprint)


@pytest.mark.parametrize("change, fragments", [
    (dict(new_addresses=[f"10.0.0.{i % 250}:{7000 + i}" for i in range(1025)]),
     ("new_addresses lists 1025 addresses", "1 to 1024")),
    (dict(old_addresses=["a:1", "a:1"]), ("old_addresses lists 'a:1' 2 times", "each shard once")),
    (dict(plan="p" * 300), ("plan is 300 characters long", "limit of 128")),
    (dict(you="y\n" * 3), ("you contains a control character",)),
    (dict(partitions=1 << 20), (f"partitions is {1 << 20}", "at most 256")),
], ids=["shards-over-cap", "address-twice", "long-plan", "control-chars", "partitions-over-cap"])
def test_a_prepare_past_the_caps_is_invalid_argument_and_takes_no_plan(shard_server, change, fragments):
    """Before: 1,025 addresses reached new_job's ValueError (UNKNOWN)."""
    job = Job(shard_server)
    request = pb.ReshardRequest(op=Op.PREPARE, plan="p1", old_addresses=job.old, new_addresses=job.new,
                                you=job.new[1])
    for field, value in change.items():
        if isinstance(value, list):
            getattr(request, field)[:] = value
        else:
            setattr(request, field, value)
    refused(lambda: job.shards[1].stub.Reshard(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, *fragments,
            unchanged=_Records(job, 1))
    assert job.reshard(1, Op.PREPARE).plan == "p1"  # still serves: the real plan is taken


@pytest.mark.parametrize("kind, payload, fragments", [
    (COPY, lambda m: {k: v for k, v in copy_payload(m).items() if k != "job"}, ("job is 'NoneType'", "hex")),
    (COPY, lambda m: copy_payload(m, params=torch.zeros(3)), ("params's length is 3", "334, the move's range")),
    (COPY, lambda m: copy_payload(m, params=torch.zeros(m.b - m.a, dtype=torch.float64)),
     ("params is 'torch.float64", "1-D float32")),
    (COPY, lambda m: copy_payload(m, a=0), ("range is '[0,", "the move's range")),
    (COPY, lambda m: copy_payload(m, optimizer={"state": {0: {"momentum_buffer": torch.zeros(2)}},
                                                "param_groups": [{}]}), ("momentum_buffer's length is 2",)),
    (COPY, lambda m: copy_payload(m, job="zz"), ("job could not be decoded",)),
    (COPY, lambda m: copy_payload(m, job=_other_job_hex()), ("range is '[666, 1000)'", "[1333, 2000)")),
    (FORWARD, lambda m: {"rounds": "x"}, ("rounds is 'str'", "1 to 16 rounds")),
    (FORWARD, lambda m: {"rounds": [{"version": 0, "lr": 0.5, "grad": torch.zeros(m.b - m.a)}] * 17},
     ("rounds is '17 rounds'",)),
    (VOTE, lambda m: {"digest": "d"}, ("timeline is 'None'", "text of at most")),
    (VOTE, lambda m: {"digest": "d", "timeline": "t", "members": {0: "t0"}, "epochs": [(0, 0, [0])],
                      "book": {0: ("t0", -1, "applied")}}, ("book is", "map ranks to (trainer id, sequence, outcome)")),
    (pb.HandoffChunk.ROWS_COPY, lambda m: {"tables": {"emb": {"version": 0}}}, ("emb.ids is 'NoneType'", "1-D int64")),
    (pb.HandoffChunk.ROWS_FORWARD, lambda m: {"tables": {"emb": [dict(
        version=1, deleted=torch.zeros(0, dtype=torch.int64), ids=torch.tensor([3, 1]), rows=torch.zeros(2, 4),
        optimizer_state=torch.zeros(2, 4), last_tick=torch.zeros(2, dtype=torch.int64),
        last_version=torch.zeros(2, dtype=torch.int64))]}}, ("emb[0].ids is 'unsorted'", "sorted with no repeats")),
    (pb.HandoffChunk.ROWS_VOTE, lambda m: {"tables": {"emb": {"version": 1}}}, ("emb is 'dict'", "final forward")),
    (7, lambda m: {}, ("kind is 7", "COPY, FORWARD, VOTE or ROWS_*")),
], ids=["copy-no-job", "copy-short-params", "copy-float64", "copy-other-range", "copy-short-momentum",
        "copy-bad-job", "copy-other-job", "forward-not-a-list", "forward-17-rounds", "vote-no-timeline",
        "vote-bad-book", "rows-copy-no-ids", "rows-forward-unsorted", "rows-vote-no-final", "kind-7"])
def test_a_handoff_payload_of_the_wrong_shape_or_size_is_invalid_argument_and_changes_nothing(
        shard_server, kind, payload, fragments):
    """Before: a COPY without its job, a FORWARD whose rounds are not a list and a VOTE without its timeline were
    UNKNOWN (KeyError, TypeError), a COPY of 3 parameters for a move of 334 was loaded as the new piece's part, and a
    refused COPY of another job had already fixed the new shard's moves from it (the real copies then refused)."""
    job = Job(shard_server)
    job.reshard(2, Op.PREPARE)
    index, move = move_to(job, 2)
    stream = chunks(kind, "p1", job.old[move.src], index, 0, payload(move))
    refused(lambda: job.shards[2].stub.Handoff(stream, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, *fragments,
            unchanged=_Records(job, 2))
    assert job.shards[2].stats().counters["handoff_copies_loaded"] == 0
    for i in (0, 1):  # still serves: the real sources' copies are taken
        job.reshard(i, Op.PREPARE)
    wait_until(lambda: [p for _, _, p, _ in records(job, 2)] == ["dest:replaying"], "the real copies to load")


def test_a_handoff_stream_that_goes_quiet_is_deadline_exceeded_and_changes_nothing(shard_server):
    """Before: a Handoff was read without the idle and total deadlines, holding its bytes and a call of its
    connection for as long as the peer kept it open."""
    job = Shards(shard_server, shard2=dict(limits=ServiceLimits(min_chunk_bytes=256, stream_idle_timeout=0.5)))
    job.reshard(2, Op.PREPARE)
    index, move = move_to(job, 2)
    release = threading.Event()

    def quiet():
        yield next(chunks(COPY, "p1", job.old[move.src], index, 0, copy_payload(move)))
        release.wait(60)

    try:
        refused(lambda: job.shards[2].stub.Handoff(quiet(), timeout=60), grpc.StatusCode.DEADLINE_EXCEEDED,
                "no chunk arrived for", "--stream-idle-timeout", unchanged=_Records(job, 2))
    finally:
        release.set()
    assert job.shards[2].stats().counters["refused_DEADLINE_EXCEEDED"] == 1


def test_a_handoff_payload_past_the_memory_budget_is_resource_exhausted_before_the_rest_is_read(shard_server):
    """Before: up to 16 GiB (MAX_PAYLOAD_BYTES) was gathered in memory whatever --max-memory said."""
    job = Shards(shard_server, shard2=dict(max_memory=200_000))
    job.reshard(2, Op.PREPARE)
    index, move = move_to(job, 2)
    sent = []

    def big():
        for k in range(6):
            sent.append(k)
            yield pb.HandoffChunk(kind=COPY, plan="p1", source=job.old[move.src], move=index, data=b"\0" * 60_000)

    refused(lambda: job.shards[2].stub.Handoff(big(), timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "size is 240000 bytes so far", "limit is 200000 bytes (--max-memory)", unchanged=_Records(job, 2))
    assert job.shards[2].stats().counters["refused_RESOURCE_EXHAUSTED"] == 1


def test_a_prepare_before_rank_0s_init_is_failed_precondition_and_takes_no_plan(shard_server):
    """Before: PREPARE of a registered job without parameters yet was UNKNOWN (copy_range of None)."""
    shard = shard_server(lease_timeout=0)
    shard.register(spec=OLD)
    here = shard.server.address
    request = pb.ReshardRequest(op=Op.PREPARE, plan="p1", old_addresses=[here, "b:1"],
                                new_addresses=[here, "b:1", "c:1"], you=here)
    refused(lambda: shard.stub.Reshard(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
            "initialized is False on partition 0", "after rank 0's Init", unchanged=_Shard(_One(shard), 0))
    assert shard.stub.Reshard(pb.ReshardRequest(op=Op.STATUS), timeout=10).handoffs == []
    assert init(shard.stub, OLD.fingerprint, P // 2).accepted  # still serves: the Init it waited for is taken
    assert shard.stub.Reshard(request, timeout=10).plan == "p1"


def test_a_prepare_whose_copies_do_not_fit_the_memory_budget_is_resource_exhausted_naming_both_numbers(
        shard_server):
    """Before: PREPARE copied the moves' ranges (and kept up to 16 rounds of forwards each) outside --max-memory."""
    held = dense_bytes(OLD, 0)
    job = Shards(shard_server, shard0=dict(max_memory=held + 100))
    refused(lambda: job.reshard(0, Op.PREPARE), grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the job's {held}", f"memory budget is {held + 100} bytes", "--max-memory", unchanged=_Records(job, 0))
    assert records(job, 0) == []  # no plan taken
    base = job.shards[0].stats(fingerprint=OLD.fingerprint).version
    assert job.push(0, base).outcome == pb.APPLIED  # still serves


def test_a_handoff_payload_is_decoded_while_the_shard_goes_on_answering_calls_and_pushes(shard_server, monkeypatch):
    """The decode is held (an event) until a GetStats (the event loop) and a push (the state worker) have been
    answered: had the payload been joined or decoded on either, they would wait behind it.  Before: joined on
    the loop (~0.2 s per 100 MiB here) and decoded there too."""
    import psserver.resharding.handoff.inbox

    job = Job(shard_server)
    job.reshard(1, Op.PREPARE)
    index, move = move_to(job, 1)
    entered, release = threading.Event(), threading.Event()
    real = psserver.resharding.handoff.inbox.unpack_parts

    def held(parts, kind):
        entered.set()
        assert release.wait(60), "the test never released the decode"
        return real(parts, kind)

    monkeypatch.setattr(psserver.resharding.handoff.inbox, "unpack_parts", held)
    with ThreadPoolExecutor(1) as pool:
        stream = chunks(COPY, "p1", job.old[move.src], index, 2, copy_payload(move))
        ack = pool.submit(job.shards[1].stub.Handoff, stream, timeout=60)
        try:
            assert entered.wait(60), "the Handoff never reached its decode"
            still_serves(job, 1)  # a push on the shard whose Handoff is being decoded
        finally:
            release.set()
        reply = ack.result(60)  # taken once decoded (its own copy of move 2 may have come before or after it)
        assert (reply.move, reply.phase in ("receiving", "replaying")) == (index, True)


@pytest.mark.parametrize("sizes, fragments", [
    ([0, 0, 0], ("chunk 0 carries 0 bytes", "at least 4096")),
    ([5000, 100, 5000], ("chunk 1 carries 100 bytes", "at least 4096")),
], ids=["empty-chunks", "a-small-chunk-mid-stream"])
def test_a_handoff_of_chunks_under_the_minimum_is_invalid_argument_at_the_next_chunk(shard_server, sizes, fragments):
    """Before: each chunk was kept, however small -- empty ones too, which the byte bound never counted, so a stream
    of empty chunks grew the shard's memory until --max-call-seconds."""
    job = Job(shard_server)
    job.reshard(2, Op.PREPARE)
    index, move = move_to(job, 2)
    stream = iter([pb.HandoffChunk(kind=COPY, plan="p1", source=job.old[move.src], move=index, data=b"\0" * n)
                   for n in sizes])
    refused(lambda: job.shards[2].stub.Handoff(stream, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, *fragments,
            unchanged=_Records(job, 2))



def test_a_new_shards_first_copy_whose_new_piece_does_not_fit_is_resource_exhausted_naming_both_numbers(
        shard_server):
    """A shard with no job at PREPARE learns the job from its first COPY: the new piece it would serve (5,344 bytes
    here) must fit in --max-memory (5,000: the 4,901-byte payload itself is under it)."""
    job = Shards(shard_server, shard2=dict(max_memory=5_000))
    job.reshard(2, Op.PREPARE)
    index, move = move_to(job, 2)
    stream = chunks(COPY, "p1", job.old[move.src], index, 0, copy_payload(move))
    refused(lambda: job.shards[2].stub.Handoff(stream, timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the new pieces of plan 'p1' need 5344 bytes", "memory budget is 5000 bytes", unchanged=_Records(job, 2))
    assert job.shards[2].stats().counters["handoff_copies_loaded"] == 0


def test_a_vote_the_new_piece_refuses_changes_neither_its_members_nor_its_timeline(shard_server):
    """Before: a vote's members, epochs and (first) timeline were kept before the machine looked at the vote, so a
    refused one changed what the switch installs."""
    job = Job(shard_server)
    job.reshard(2, Op.PREPARE)
    index, move = move_to(job, 2)
    job.shards[2].stub.Handoff(chunks(COPY, "p1", job.old[move.src], index, 0, copy_payload(move)), timeout=10)
    vote = dict(digest="0" * 64, timeline="t-first", members={0: "t0"}, epochs=[(0, 0, [0])], book={})
    job.shards[2].stub.Handoff(chunks(VOTE, "p1", job.old[move.src], index, 0, vote), timeout=10)  # abort: dropped
    piece = job.shards[2].server.handoffs.dests[move.dst_part]
    kept = (piece.timeline, piece.members, piece.epochs)
    other = dict(digest="1" * 64, timeline="t-evil", members={0: "mallory"}, epochs=[(0, 0, [0, 1])], book={})
    refused(lambda: job.shards[2].stub.Handoff(chunks(VOTE, "p1", job.old[move.src], index, 0, other), timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION, "a vote for part 0", "in state dropped", unchanged=_Records(job, 2))
    assert (piece.timeline, piece.members, piece.epochs) == kept == ("t-first", {0: "t0"}, [(0, 0, [0])])
