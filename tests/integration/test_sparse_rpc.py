"""PullRows and PushRows against real shards on loopback: rows, modes, exactly-once, refusals that change nothing."""

from __future__ import annotations

import grpc
import pytest
import torch

from psserver.protocol import limits
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.init import init_rows
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.space import RowSpace
from psserver.protocol.rows.table import RowStore, TableSpec
from psserver.protocol.rows.wire import row_chunks
from tests.conftest import P, make_spec
from tests.helpers import refused
from trainer.channels.client import RetryPolicy, ShardedClient
from trainer.tables.sparse_client import RowsCallFailed, RowsPushFailed, ShardedRows

DIM = 4
FP = "f" * 16


def table(optimizer="sgd", **kw) -> TableSpec:
    return TableSpec("emb", DIM, optimizer=SparseOptimizerConfig(optimizer, lr=0.1), seed=7, **kw)


def job(num_shards=1, num_trainers=1, mode="sync", **tkw):
    return make_spec(num_shards=num_shards, num_trainers=num_trainers, mode=mode, tables=(table(**tkw),))


def cluster(shard_server, spec, retry=RetryPolicy()):
    """Shards of ``spec`` and one registered (ShardedClient, ShardedRows) per trainer; closed by the caller."""
    raws = [shard_server(shard=i) for i in range(spec.num_shards)]
    trainers = []
    for rank in range(spec.num_trainers):
        client = ShardedClient([r.server.address for r in raws], spec, rank, f"t{rank}", retry=retry)
        for s in client.shards:
            s.registrar.register(spec, connect_timeout=10)
        trainers.append((client, ShardedRows(client, spec)))
    return raws, trainers


def close(trainers):
    for client, rows in trainers:
        rows.close()
        client.close()


def test_fresh_ids_read_their_initial_rows_from_the_shard_that_owns_them(shard_server):
    spec = job(num_shards=2)
    raws, trainers = cluster(shard_server, spec)
    try:
        ids = torch.randperm(1000)[:100] * 7919
        rows = trainers[0][1].pull("emb", ids)
        assert torch.equal(rows, init_rows(spec.tables[0].initializer, 7, ids, DIM))
        owners = shard_of(ids, 2)
        for i, raw in enumerate(raws):
            assert raw.stats().counters["table.emb.live_rows"] == int((owners == i).sum())
        assert trainers[0][1].counters["bytes_pulled"] == 100 * (8 + DIM * 4)  # ids out, rows back: nothing else
    finally:
        close(trainers)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_sync_trainers_give_the_rows_of_one_store_applying_the_merged_average(shard_server, optimizer):
    spec = job(num_shards=2, num_trainers=2, optimizer=optimizer)
    raws, trainers = cluster(shard_server, spec)
    reference = RowStore(spec.tables[0])
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(4):
            batches = []
            for rank, (_, rows) in enumerate(trainers):
                ids = torch.randperm(40, generator=gen)[:15]
                pulled = rows.pull("emb", ids)
                assert torch.equal(pulled, reference.lookup(ids))  # the rows of the version after the last round
                batches.append((ids, torch.randn(15, DIM, generator=gen), 2 + rank))
            for (_, rows), (ids, grads, n) in zip(trainers, batches):
                rows.push("emb", ids, grads, n)
            union = torch.unique(torch.cat([b[0] for b in batches]))
            total = torch.zeros(len(union), DIM)
            for ids, grads, n in batches:  # in arrival order; with two trainers the order does not matter
                total.index_add_(0, torch.searchsorted(union, ids), grads.mul(float(n)))
            reference.apply(union, total.div_(float(sum(b[2] for b in batches))))
        everything = torch.arange(40)
        assert torch.equal(trainers[0][1].pull("emb", everything), reference.lookup(everything))
        assert trainers[1][1].versions() == {"emb": [4, 4]}
        assert [r.stats().counters["table.emb.version"] for r in raws] == [4, 4]
    finally:
        close(trainers)


def test_async_applies_each_push_at_once_and_counts_rows_too_stale(shard_server):
    spec = job(num_trainers=2, mode="async", max_staleness=0)
    raws, trainers = cluster(shard_server, spec)
    (_, a), (_, b) = trainers
    try:
        ids = torch.tensor([5, 6])
        start = a.pull("emb", ids)
        b.pull("emb", ids[:1])
        b.push("emb", ids[:1], torch.ones(1, DIM), 1)  # applied at once: version 1
        assert b.versions() == {"emb": [1]}
        a.push("emb", ids, torch.ones(2, DIM), 1)  # a read row 5 at version 0; b has updated it since
        assert a.counters["rows_stale"] == 1
        after = a.pull("emb", ids)
        assert torch.equal(after[1], start[1] - 0.1)  # row 6 applied
        assert torch.equal(after[0], start[0] - 0.1)  # row 5: b's update only
        assert raws[0].stats().counters["table.emb.rows_stale"] == 1
    finally:
        close(trainers)


# ---------------------------------------------------------------------------------------------- raw calls
def pull_rows(raw, ids, rank=0, table_name="emb", min_version=0, raw_ids=None, fingerprint=FP, timeout=10):
    req = pb.PullRowsRequest(rank=rank, trainer_id=f"t{rank}", fingerprint=fingerprint, table=table_name,
                             min_version=min_version,
                             ids=raw_ids if raw_ids is not None else torch.tensor(ids).numpy().tobytes())
    chunks = list(raw.stub.PullRows(req, timeout=timeout))
    data = b"".join(c.rows for c in chunks)
    return chunks[0].header.version, torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, DIM)


def rows_chunks(ids, grads=None, rank=0, seq=1, base=0, dim=DIM, table_name="emb", num_ids=None, n=1,
                fingerprint=FP, chunk_bytes=1 << 20):
    ids = torch.tensor(ids, dtype=torch.int64)
    grads = torch.ones(len(ids), DIM) if grads is None else grads
    header = pb.RowsHeader(rank=rank, trainer_id=f"t{rank}", fingerprint=fingerprint, table=table_name,
                           version=base, num_samples=n, sequence=seq, dim=dim,
                           num_ids=len(ids) if num_ids is None else num_ids)
    return list(row_chunks(grads, header, chunk_bytes, ids))


def push_rows(raw, chunks):
    return raw.stub.PushRows(iter(chunks), timeout=10)


def started(shard_server, **tkw):
    raw = shard_server()
    raw.register(spec=job(**tkw))
    return raw


def test_a_retried_push_with_the_acknowledged_sequence_is_a_duplicate(shard_server):
    raw = started(shard_server, mode="async")
    assert push_rows(raw, rows_chunks([1, 2])).outcome == pb.APPLIED
    after = raw.digest()
    reply = push_rows(raw, rows_chunks([1, 2]))  # the reply was "lost": the same sequence again
    assert (reply.outcome, reply.version) == (pb.DUPLICATE, 1)
    assert raw.digest() == after
    assert raw.stats().counters["table.emb.pushes_duplicate"] == 1


def _tiled_wrong(chunks):
    chunks[1].offset += 1
    return chunks


def _rows_short(chunks):
    chunks[0].rows = chunks[0].rows[:-4]
    return chunks


def _ids_ragged(chunks):
    chunks[0].ids = chunks[0].ids + b"\0"
    return chunks


PUSH_REFUSALS = {
    "unknown table": (dict(table_name="nope"), None, grpc.StatusCode.INVALID_ARGUMENT, "table is 'nope'"),
    "id out of range": (dict(ids=[100]), None, grpc.StatusCode.INVALID_ARGUMENT, "id 100 is out of range"),
    "wrong dim": (dict(dim=DIM + 1), None, grpc.StatusCode.INVALID_ARGUMENT, "dim is 5 but table 'emb'"),
    "row bytes": (dict(), _rows_short, grpc.StatusCode.INVALID_ARGUMENT, "bytes of rows but its 2 ids need"),
    "ids not 8 bytes": (dict(), _ids_ragged, grpc.StatusCode.INVALID_ARGUMENT, "not a multiple of 8"),
    "nan": (dict(grads=torch.full((2, DIM), float("nan"))), None, grpc.StatusCode.INVALID_ARGUMENT,
            "NaN or infinite"),
    "duplicate ids": (dict(ids=[3, 3]), None, grpc.StatusCode.INVALID_ARGUMENT, "id 3 appears 2 times"),
    "over the id cap": (dict(num_ids=limits.MAX_IDS_PER_CALL + 1), None, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"num_ids is {limits.MAX_IDS_PER_CALL + 1}, over the limit"),
    "tiling": (dict(ids=list(range(40)), grads=torch.ones(40, DIM), chunk_bytes=256), _tiled_wrong,
               grpc.StatusCode.INVALID_ARGUMENT, "chunk offset is"),
    "fewer ids than declared": (dict(ids=list(range(20)), grads=torch.ones(20, DIM), num_ids=21), None,
                                grpc.StatusCode.INVALID_ARGUMENT, "cover ids [0, 20) but num_ids is 21"),
    "future base": (dict(base=5), None, grpc.StatusCode.OUT_OF_RANGE, "base version is 5 but table 'emb'"),
    "not a member": (dict(rank=1), None, grpc.StatusCode.NOT_FOUND, "rank 1 is not registered"),
    "other job": (dict(fingerprint="0" * 16), None, grpc.StatusCode.FAILED_PRECONDITION, "fingerprint is"),
    "sequence 0": (dict(seq=0), None, grpc.StatusCode.INVALID_ARGUMENT, "sequence is 0"),
    "zero samples": (dict(n=0), None, grpc.StatusCode.INVALID_ARGUMENT,
                     "num_samples is 0 but a gradient needs at least 1 sample"),
}


@pytest.mark.parametrize("case", PUSH_REFUSALS)
def test_a_refused_push_changes_no_state_and_the_shard_goes_on_serving(shard_server, case):
    raw = started(shard_server, num_trainers=2, num_embeddings=100)
    assert push_rows(raw, rows_chunks([1, 2])).outcome == pb.ACCEPTED  # an open round the refusal must not touch
    before = raw.digest()
    kw, spoil, code, fragment = PUSH_REFUSALS[case]
    kw = dict(kw)
    ids = kw.pop("ids", [8, 9])
    chunks = rows_chunks(ids, **kw)
    refused(lambda: push_rows(raw, spoil(chunks) if spoil else chunks), code, fragment)
    assert raw.digest() == before
    assert pull_rows(raw, [1, 2])[0] == 0  # still serving


PULL_REFUSALS = {
    "unknown table": (dict(table_name="nope"), grpc.StatusCode.INVALID_ARGUMENT, "table is 'nope'"),
    "ids not 8 bytes": (dict(raw_ids=b"\0" * 12), grpc.StatusCode.INVALID_ARGUMENT, "12 bytes, not a multiple of 8"),
    "repeated ids": (dict(ids=[4, 4]), grpc.StatusCode.INVALID_ARGUMENT, "id 4 appears 2 times"),
    "out of range": (dict(ids=[-1]), grpc.StatusCode.INVALID_ARGUMENT, "id -1 is out of range"),
    "over the id cap": (dict(raw_ids=b"\0" * 8 * (limits.MAX_IDS_PER_CALL + 1)),
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit of"),
    "not a member": (dict(rank=1), grpc.StatusCode.NOT_FOUND, "rank 1 is not registered"),
}


@pytest.mark.parametrize("case", PULL_REFUSALS)
def test_a_refused_pull_creates_no_row(shard_server, case):
    raw = started(shard_server, num_trainers=2, num_embeddings=100)
    before = raw.digest()
    kw, code, fragment = PULL_REFUSALS[case]
    kw = dict(kw)
    ids = kw.pop("ids", [1])
    refused(lambda: pull_rows(raw, ids, **kw), code, fragment)
    assert raw.digest() == before and raw.stats().counters["table.emb.live_rows"] == 0


def test_an_id_sent_to_a_shard_that_does_not_own_it_is_refused(shard_server):
    spec = job(num_shards=2)
    raw = shard_server(shard=0)
    raw.register(spec=spec)
    foreign = next(i for i in range(100) if int(shard_of(torch.tensor([i]), 2)) == 1)
    refused(lambda: pull_rows(raw, [foreign]), grpc.StatusCode.INVALID_ARGUMENT, f"id {foreign} lives on shard 1")


def test_a_sync_pull_waits_for_the_round_and_gives_up_at_its_deadline(shard_server):
    raw = started(shard_server, num_trainers=2)
    push_rows(raw, rows_chunks([1]))
    refused(lambda: pull_rows(raw, [1], min_version=1, timeout=1.5), grpc.StatusCode.DEADLINE_EXCEEDED,
            "min_version 1 was not reached")
    raw.register(rank=1, spec=job(num_trainers=2))
    assert push_rows(raw, rows_chunks([1], rank=1)).outcome == pb.APPLIED
    assert pull_rows(raw, [1], min_version=1)[0] == 1


def test_a_push_that_fails_on_one_shard_is_retried_there_alone_with_the_same_sequence(shard_server):
    spec = job(num_shards=2, mode="async")
    raws, trainers = cluster(shard_server, spec, retry=RetryPolicy(budget_seconds=0.3))
    client, rows = trainers[0]
    try:
        raws[1].server.stop(grace=0)
        ids = torch.arange(20)
        with pytest.raises(RowsPushFailed) as e:
            rows.push("emb", ids, torch.ones(20, DIM), 1)
        assert e.value.done == [0] and list(e.value.failed) == [1]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and raws[1].server.address in e.value.details()
        with pytest.raises(RowsPushFailed):
            rows.push("emb", ids, torch.ones(20, DIM), 1)  # only shard 1 is tried again
        counters = raws[0].stats().counters
        assert counters["table.emb.pushes_applied"] == 1 and counters["table.emb.pushes_duplicate"] == 0
        assert rows.book.lanes[(1, "emb")].sequence == 1  # the unanswered push kept its number
        with pytest.raises(RowsCallFailed, match=f"shard 1 at {raws[1].server.address}: UNAVAILABLE"):
            rows.pull("emb", ids)
    finally:
        close(trainers)


def test_a_pull_whose_reply_would_pass_the_byte_limit_is_refused_before_any_row_exists(shard_server):
    raw = shard_server(max_push_bytes=1024)
    raw.register(spec=job())
    before = raw.digest()
    # 100 rows of the table's dim take more than 1024 bytes: refused naming both, nothing created
    refused(lambda: pull_rows(raw, list(range(100))), grpc.StatusCode.RESOURCE_EXHAUSTED, "over this shard's limit of 1024")
    assert raw.digest() == before and raw.stats().counters["table.emb.live_rows"] == 0
    assert len(pull_rows(raw, [1])[1]) == 1  # still serving, and small pulls pass


NO_MEMORY = {
    "torch's allocator": RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate "
                                      "memory: you tried to allocate 805306368 bytes. Error code 12"),
    "MemoryError": MemoryError(),
}


@pytest.mark.parametrize("failure", list(NO_MEMORY))
def test_a_register_whose_table_does_not_fit_is_resource_exhausted_and_makes_nothing(shard_server, monkeypatch,
                                                                                     failure):
    raw = shard_server()
    fresh = raw.digest()

    def allocation_fails(space, capacity):
        raise NO_MEMORY[failure]

    with monkeypatch.context() as m:
        m.setattr(RowSpace, "alloc", allocation_fails)
        refused(lambda: raw.register(spec=job()), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "table 'emb' (dim 4, optimizer sgd) did not fit in this shard's memory")
    stats = raw.stats()
    assert not stats.HasField("job") and stats.partitions == 1 and raw.digest() == fresh
    # the same job, now that it fits, registers and trains
    raw.register(spec=job())
    assert pull_rows(raw, [1, 2])[0] == 0
    assert push_rows(raw, rows_chunks([1, 2])).outcome == pb.APPLIED
    raw.init(torch.zeros(P))
    assert raw.push(torch.ones(P)).outcome == pb.APPLIED
