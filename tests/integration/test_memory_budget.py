"""The shard's memory budget over the wire (issue 20, findings 2 and 4): Register is all or nothing, table state
grows with rows, tables without max_rows are bounded by default, and a huge PullRows runs off the event loop.

Every refusal: RESOURCE_EXHAUSTED naming what did not fit, the state digest and the partition count as before,
and the shard then registers a sane job and trains it.  Memory is asserted on the shard's own accounting
(GetStats' memory_* counters), never on RSS.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psserver.partition.host
from psserver.protocol import limits
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import START_BYTES, TableSpec, row_bytes
from psserver.sparse.serving import ServedTable
from psserver.state.budget import dense_bytes
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until
from tests.integration.test_sparse_rpc import FP, job, pull_rows, push_rows, rows_chunks

MiB = 1 << 20


def big_spec(params: int, partitions: int = 1, optimizer: str = "adam", tables=()) -> JobSpec:
    return JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=params, fingerprint="f" * 16,
                   optimizer=OptimizerConfig(optimizer, lr=0.1), tensors=(("w", (params,), "float32"),),
                   partitions=partitions, tables=tables)


def register(raw, spec, partition=0):
    return raw.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=spec.to_proto(), partition=partition),
                             timeout=10)


def assert_as_fresh(raw, fresh_digest: str) -> None:
    """No job, one partition, nothing reserved, the digest of a fresh shard."""
    stats = raw.stats()
    assert not stats.HasField("job") and stats.partitions == 1 and not stats.initialized
    assert stats.counters["memory_reserved_bytes"] == 0 and stats.counters["memory_tables_bytes"] == 0
    assert raw.digest() == fresh_digest


def assert_trains(raw) -> None:
    """A sane job registers, initialises and steps."""
    raw.register(spec=make_spec())
    assert raw.init(torch.zeros(P)).accepted
    assert raw.push(torch.ones(P)).outcome == pb.APPLIED
    version, weights = raw.pull(min_version=1)
    assert version == 1 and torch.allclose(weights, torch.full((P,), -0.5))


# ---------------------------------------------------------------- Register: all or nothing
def test_a_register_over_the_memory_budget_is_resource_exhausted_naming_the_field_and_makes_nothing(shard_server):
    raw = shard_server(max_memory=8 * MiB)
    fresh = raw.digest()
    spec = big_spec(1 << 20)  # 4 MiB of parameters, 8 more of Adam's moments, a round sum, a pull snapshot
    need = dense_bytes(spec, 0)
    assert need == 20 * MiB
    refused(lambda: register(raw, spec), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "total_params needs", f"{need} bytes", f"memory budget is {8 * MiB} bytes", "--max-memory")
    assert_as_fresh(raw, fresh)
    assert raw.stats().counters["memory_budget_bytes"] == 8 * MiB
    assert_trains(raw)
    assert raw.stats().counters["memory_reserved_bytes"] == dense_bytes(make_spec(), 0)


def test_a_partitioned_register_over_the_budget_creates_no_partition(shard_server):
    raw = shard_server(max_memory=8 * MiB)
    fresh = raw.digest()
    spec = big_spec(1 << 20, partitions=200)
    refused(lambda: register(raw, spec, partition=150), grpc.StatusCode.RESOURCE_EXHAUSTED, "total_params needs",
            "200 partition(s)")
    assert_as_fresh(raw, fresh)
    assert_trains(raw)
    assert raw.stats().partitions == 1


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory: "
                                                                 "you tried to allocate 4194304 bytes")])
def test_a_slice_that_fails_to_allocate_at_register_is_resource_exhausted_and_leaves_the_shard_as_before(
        shard_server, monkeypatch, failure):
    raw = shard_server()
    fresh = raw.digest()
    real, calls = psserver.partition.host.allocate_slice, []

    def third_fails(elements):
        calls.append(elements)
        if len(calls) == 3:
            raise failure
        return real(elements)

    with monkeypatch.context() as m:
        m.setattr(psserver.partition.host, "allocate_slice", third_fails)
        refused(lambda: register(raw, big_spec(1 << 16, partitions=8)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "partition 2's slice could not be allocated", "total_params needs", "memory budget is")
    assert len(calls) == 3
    assert_as_fresh(raw, fresh)
    assert_trains(raw)


def test_a_partitioned_job_under_the_budget_registers_every_partition_and_trains_each(shard_server):
    raw = shard_server(max_memory=64 * MiB)
    spec = big_spec(4096, partitions=4, optimizer="sgd")
    for k in range(4):
        register(raw, spec, partition=k)
    stats = raw.stats()
    assert stats.partitions == 4 and stats.counters["memory_reserved_bytes"] == dense_bytes(spec, 0)
    for k in range(4):
        start, end = raw.stats(partition=k).start, raw.stats(partition=k).end
        n = end - start
        h = raw.header(n=n)
        h.partition = k
        assert raw.stub.Init(encode(wire_tensor(torch.zeros(n), pb.FLOAT32), h, 4096), timeout=10).accepted
        h.num_samples = 4
        assert raw.stub.Push(encode(wire_tensor(torch.ones(n), pb.FLOAT32), h, 4096), timeout=10).outcome \
            == pb.APPLIED
        assert raw.stats(partition=k).version == 1


# ---------------------------------------------------------------- table state grows with rows
def test_a_dim_65536_adam_table_holds_no_more_than_its_first_row_at_register(shard_server):
    wide = TableSpec("wide", 1 << 16, optimizer=SparseOptimizerConfig("adam", lr=0.01))
    raw = shard_server(max_memory=128 * MiB)  # its update scratch keeps 64 padded rows (64 MiB): in the budget
    register(raw, make_spec(tables=(wide,)))
    held = raw.stats().counters["memory_tables_bytes"]
    assert row_bytes(wide) > START_BYTES  # one row: 768 KiB of values and moments
    assert 0 < held <= row_bytes(wide) + MiB  # not 1,024 rows (769 MB)
    req = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="wide",
                             ids=torch.tensor([5, 6, 7]).numpy().tobytes())
    assert sum(len(c.rows) for c in raw.stub.PullRows(req, timeout=30)) == 3 * (1 << 16) * 4
    grown = raw.stats().counters["memory_tables_bytes"]
    assert 3 * row_bytes(wide) - 200 <= grown <= 4 * row_bytes(wide) + MiB  # doubling: room for at most 4


# ---------------------------------------------------------------- tables have a memory bound by default
def bounded(shard_server, mode="sync"):
    """A shard whose budget leaves table 'emb' (dim 4, sgd, no max_rows) a few hundred rows."""
    raw = shard_server(max_memory=200_000)
    raw.register(spec=job(mode=mode))
    stats = raw.stats()
    limit = int(stats.counters["table.emb.row_limit"])
    assert 100 < limit < 1000
    return raw, limit


def test_a_table_without_max_rows_gets_a_row_limit_from_the_budget_and_its_bytes_stay_in_its_share(shard_server):
    raw, limit = bounded(shard_server)
    assert pull_rows(raw, list(range(limit)))[1].shape == (limit, 4)
    c = raw.stats().counters
    assert c["table.emb.live_rows"] == limit
    assert 0 < c["memory_tables_bytes"] <= c["memory_tables_budget_bytes"] <= c["memory_reserved_bytes"] \
        <= c["memory_budget_bytes"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_call_that_would_add_rows_past_the_row_limit_is_refused_and_the_table_goes_on_serving(shard_server, mode):
    raw, limit = bounded(shard_server, mode)
    pull_rows(raw, list(range(limit - 1)))
    refused(lambda: pull_rows(raw, [limit - 1, limit, limit + 1]), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "table 'emb' holds", f"row limit is {limit}", "would add 3", "max_rows", unchanged=raw)
    refused(lambda: push_rows(raw, rows_chunks([limit + 5, limit + 6])), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "row limit", unchanged=raw)
    assert raw.stats().counters["table.emb.live_rows"] == limit - 1
    pull_rows(raw, [limit - 1])  # the last row that fits
    assert push_rows(raw, rows_chunks([0, 1])).outcome == pb.APPLIED  # known rows go on training
    refused(lambda: pull_rows(raw, [10 ** 9]), grpc.StatusCode.RESOURCE_EXHAUSTED, "would add 1")


def test_a_table_with_max_rows_over_the_budget_is_refused_at_register(shard_server):
    raw = shard_server(max_memory=200_000)
    fresh = raw.digest()
    refused(lambda: raw.register(spec=job(max_rows=100_000)), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "tables[emb].max_rows needs", "100000 rows of", "memory budget is 200000 bytes")
    assert_as_fresh(raw, fresh)
    raw.register(spec=job(max_rows=100))
    assert raw.stats().counters["table.emb.row_limit"] == 100


# ---------------------------------------------------------------- a huge PullRows runs off the event loop
def test_health_and_heartbeats_answer_while_a_pull_of_a_million_ids_is_being_served(shard_server, monkeypatch):
    """The pull's lookup is held (an event) until heartbeats and health checks have been answered: had it run on
    the event loop, they would wait behind it and time out."""
    raw = shard_server()
    raw.register(spec=job())
    entered, release = threading.Event(), threading.Event()
    real_lookup = ServedTable.lookup

    def held_lookup(self, ids):
        entered.set()
        assert release.wait(60), "the test never released the pull"
        return real_lookup(self, ids)

    monkeypatch.setattr(ServedTable, "lookup", held_lookup)
    n = limits.MAX_IDS_PER_CALL
    result = {}
    puller = threading.Thread(target=lambda: result.setdefault("rows", pull_rows(raw, None, timeout=120,
                                                                               raw_ids=torch.arange(n).numpy()
                                                                               .tobytes())[1]))
    puller.start()
    try:
        wait_until(entered.is_set, "the big pull to reach its lookup")
        hb = raw.stub.Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id="t0", fingerprint=FP), timeout=10)
        assert hb.live == 1
        assert raw.stats().counters["registrations"] == 1
        health = health_pb2_grpc.HealthStub(raw.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert puller.is_alive()  # the pull was still being served all along
    finally:
        release.set()
        puller.join(120)
    assert result["rows"].shape == (n, 4)
