"""Partitioned and pipelined exchange against the plain one, on real shards over loopback.

Each partition has its own round, version and optimizer step (psserver.partition.host); element-wise optimizers make
that the same arithmetic as one step over the slice, so sync mode must give the same parameters bit for bit --
also when steps return before the exchange ends and each layer waits for its own partitions (trainer.stepping.pipeline).
"""

from __future__ import annotations

import grpc
import pytest
import torch
from torch.nn import functional as F

from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused, run_ranks
from trainer import connect

STEPS = 5


class Net(torch.nn.Module):
    """Four layers of uneven sizes (2,180 parameters), so partition edges fall inside tensors."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 40)
        self.b = torch.nn.Linear(40, 30)
        self.c = torch.nn.Linear(30, 12)
        self.d = torch.nn.Linear(12, 10)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


class Tiny(torch.nn.Module):
    """514 parameters: two slices of 257 = one 256-element unit (psserver.protocol.layout.PARTITION_ALIGN) and one
    element, so three partitions a shard are one empty, one of 256 elements and one of a single element."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Linear(2, 170)  # 510 parameters
        self.v = torch.nn.Linear(1, 2)  # 4

    def forward(self, x):
        return self.v(torch.tanh(self.w(x))[:, :1] + torch.tanh(self.w(x)).mean(1, keepdim=True))


def batches(rank: int, steps: int, features: int, classes: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, features, generator=g), torch.randint(0, classes, (8,), generator=g))
            for _ in range(steps)]


def train_cluster(addresses: str, optimizer: dict, num_trainers: int = 2, model_cls=Net, **options):
    """``num_trainers`` trainers (threads) run STEPS sync steps; every trainer's parameters after them, and
    what they saw of the job."""
    features, classes = (12, 10) if model_cls is Net else (2, 2)
    results, seen = {}, {}

    models = [model_cls() for _ in range(num_trainers)]  # here: a model seeds torch's global generator

    def run(rank: int) -> None:
        model = models[rank]
        with connect(addresses, model, mode="sync", rank=rank, num_trainers=num_trainers, optimizer=optimizer,
                     connect_timeout=30, **options) as ps:
            seen[rank] = (ps.job.partitions, ps.num_parts)
            for x, y in batches(rank, STEPS, features, classes):
                ps.prepare_step(len(x))
                F.cross_entropy(model(x), y).backward()
                ps.step(num_samples=len(x))
            ps.flush()
            seen[rank] += (ps._waits.waits if ps._waits is not None else 0,)
            results[rank] = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])

    run_ranks(run, num_trainers, timeout=None)
    return results, seen


OPTIMIZERS = [{"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
              {"name": "adam", "lr": 0.01}]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("options", [
    dict(partition_bytes=1000),  # 250 elements: the 1,090-element slices cut in 5 uneven pieces
    dict(partition_bytes=1000, pipeline=True),
    dict(partition_bytes=1000, pipeline=True, push_during_backward=True),
    dict(pipeline=True),  # one partition per shard, pipelined
], ids=["partitioned", "pipelined", "pipelined-early-push", "pipelined-whole-slices"])
def test_partitioned_and_pipelined_exchange_equal_whole_slices_bit_for_bit(shard_server, optimizer, options):
    def fresh():
        return ",".join(shard_server(shard=i).server.address for i in range(2))

    plain, plain_seen = train_cluster(fresh(), optimizer)
    cut, cut_seen = train_cluster(fresh(), optimizer, **options)
    assert plain_seen[0][:2] == (1, 2)
    expected_partitions = 5 if options.get("partition_bytes") else 1
    assert cut_seen[0][:2] == (expected_partitions, 2 * expected_partitions)
    for rank in (0, 1):
        assert torch.equal(cut[rank], plain[rank]), f"rank {rank}: max diff {(cut[rank] - plain[rank]).abs().max()}"
    assert torch.equal(cut[0], cut[1])


def test_empty_and_one_element_partitions_train_like_whole_slices(shard_server):
    """Each 257-element slice in 3 partitions: [0, 0), [0, 256), [256, 257) -- an empty one, whose pushes and
    pulls are of zero elements, and a one-element one."""
    optimizer = {"name": "adam", "lr": 0.05}

    def fresh():
        return ",".join(shard_server(shard=i).server.address for i in range(2))

    plain, _ = train_cluster(fresh(), optimizer, model_cls=Tiny)
    cut, seen = train_cluster(fresh(), optimizer, model_cls=Tiny, partition_bytes=4, pipeline=True)
    assert seen[0][:2] == (2, 4)  # 2 units a slice: never more partitions than units
    with_three, seen3 = train_cluster(fresh(), optimizer, model_cls=Tiny, partitions=3, pipeline=True)
    assert seen3[0][:2] == (3, 6)
    assert torch.equal(cut[0], plain[0]) and torch.equal(cut[1], plain[1])


def test_each_partition_keeps_its_own_version_and_the_shard_reports_them(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    train_cluster(",".join(s.server.address for s in shards), OPTIMIZERS[0], partition_bytes=1000)
    for s in shards:
        head = s.stub.GetStats(pb.StatsRequest(partition=0), timeout=10)
        assert head.partitions == 5
        ranges = []
        for k in range(5):
            stats = s.stub.GetStats(pb.StatsRequest(partition=k), timeout=10)
            assert stats.version == STEPS  # one optimizer step per sync round, per partition
            ranges.append((stats.start, stats.end))
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # the partitions tile the slice
        assert head.counters["steps"] == 5 * STEPS  # counters: every partition's summed


def _digests(raw, partitions):
    return [raw.digest(partition=k) for k in range(partitions)]


def test_a_call_naming_a_partition_the_shard_lacks_is_refused_and_changes_nothing(shard_server):
    raw = shard_server()
    spec = make_spec(partitions=2)
    raw.register(spec=spec)
    halves = [raw.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=spec.to_proto(), partition=k),
                                timeout=10) for k in range(2)]
    sizes = [512, 488]  # two and a partial 256-element unit (psserver.protocol.layout.PARTITION_ALIGN)
    assert [(h.start, h.end) for h in halves] == [(0, 512), (512, 1000)]
    for k in range(2):
        h = raw.header(n=sizes[k])
        h.partition = k
        raw.stub.Init(iter([pb.Chunk(header=h, offset=0, data=torch.full((sizes[k],), float(k)).numpy().tobytes())]),
                      timeout=10)
    before = _digests(raw, 2)

    h = raw.header(n=488)
    h.partition = 2
    refused(lambda: raw.stub.Push(iter([pb.Chunk(header=h, offset=0, data=bytes(4 * 488))]), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, "partition is 2", "serves 2 partitions")
    pull = pb.PullRequest(rank=0, trainer_id="t0", fingerprint="f" * 16, partition=7)
    refused(lambda: list(raw.stub.Pull(pull, timeout=10)), grpc.StatusCode.INVALID_ARGUMENT, "partition is 7")
    register = pb.RegisterRequest(rank=0, trainer_id="t0", job=spec.to_proto(), partition=2)
    refused(lambda: raw.stub.Register(register, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
            "partition is 2 but the job has 2 partitions")
    # A push of the wrong length for its partition names both lengths.
    h = raw.header(n=1000)
    h.partition = 1
    refused(lambda: raw.stub.Push(iter([pb.Chunk(header=h, offset=0, data=bytes(4000))]), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, "1000", "488")

    assert _digests(raw, 2) == before
    version, weights = raw.pull()  # partition 0 still serves
    assert version == 0 and torch.equal(weights, torch.zeros(512))


def test_a_job_with_more_partitions_than_the_limit_is_refused_naming_both(shard_server):
    raw = shard_server()
    spec = make_spec()
    message = spec.to_proto()
    message.partitions = 100_000
    refused(lambda: raw.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=message), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, "partitions per shard (100000)", "256")
    assert raw.stats().initialized is False


WIDE = make_spec(partitions=256)
REFUSED_REGISTERS = {  # (request fields, status, fragment of the message)
    "rank 1 of 1": (dict(rank=1, partition=0), grpc.StatusCode.INVALID_ARGUMENT, "rank is 1 but the job has 1 trainer"),
    "wrong shard": (dict(expected_shard=1, partition=0), grpc.StatusCode.FAILED_PRECONDITION,
                    "this is shard 0 but the trainer listed it as shard 1"),
    "partition 300": (dict(partition=300), grpc.StatusCode.INVALID_ARGUMENT,
                      "partition is 300 but the job has 256 partitions"),
    "rank 1 of 1 on partition 255": (dict(rank=1, partition=255), grpc.StatusCode.INVALID_ARGUMENT,
                                     "rank is 1 but the job has 1 trainer"),
}


@pytest.mark.parametrize("case", list(REFUSED_REGISTERS))
def test_a_refused_register_of_a_partitioned_job_makes_no_partition(shard_server, case):
    raw = shard_server()
    fresh = raw.digest()
    fields, code, fragment = REFUSED_REGISTERS[case]
    request = dict(rank=0, trainer_id="t0", expected_shard=0, job=WIDE.to_proto())
    refused(lambda: raw.stub.Register(pb.RegisterRequest(**{**request, **fields}), timeout=10), code, fragment)
    stats = raw.stats()
    assert stats.partitions == 1 and not stats.HasField("job") and raw.digest() == fresh
    raw.register()  # the next job, of one partition, is served as one
    assert raw.stats().partitions == 1
    raw.init(torch.zeros(P))
    assert raw.push(torch.ones(P)).outcome == pb.APPLIED


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_a_partitioned_trainer_rides_out_a_shard_that_restarts_empty(shard_server, pipeline):
    """Every partition of the restarted shard answers "register first" (FAILED_PRECONDITION), never
    INVALID_ARGUMENT: the trainer registers each again, rank 0 initialises it, and training goes on."""
    from psserver.serving.server import ServerConfig, ShardServer
    from psserver.serving.service import ServiceLimits

    shards = [shard_server(shard=i) for i in range(2)]
    model = Net()
    batches_ = batches(0, 6, 12, 10)
    with connect(",".join(s.server.address for s in shards), model, mode="sync", partitions=3, pipeline=pipeline,
                 optimizer=OPTIMIZERS[0], connect_timeout=30, retry_budget=30) as ps:
        for x, y in batches_[:2]:
            F.cross_entropy(model(x), y).backward()
            ps.step(num_samples=len(x))
        ps.flush()
        port = shards[1].server.port
        shards[1].server.stop(grace=0)
        restarted = ShardServer(ServerConfig(shard=1, port=port, limits=ServiceLimits(min_chunk_bytes=256))).start()
        try:
            for x, y in batches_[2:]:
                F.cross_entropy(model(x), y).backward()
                ps.step(num_samples=len(x))
            ps.flush()
            assert ps.counters["reconnects"] == 3  # each partition of the restarted shard, once
            assert all(p.version >= 1 for p in restarted.shard.parts)  # every partition trains again
            assert len(restarted.shard.parts) == 3
        finally:
            ps.close()
            restarted.stop(grace=0)


def test_pipelined_steps_with_shard_backed_tables_are_refused_before_connecting():
    from trainer.tables.embedding import ShardedEmbedding

    model = torch.nn.Sequential(ShardedEmbedding("users", 8), torch.nn.Linear(8, 1))
    with pytest.raises(ValueError, match="pipeline with shard-backed embedding tables is not supported"):
        connect("127.0.0.1:1", model, pipeline=True, connect_timeout=1)
