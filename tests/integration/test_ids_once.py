"""Ids once (issue 21 item 4) against real shards on loopback: a push names the pull its rows were read at; a
reference the shard does not hold is refused and changes nothing; a trainer sends that push again with its ids."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch

from psserver.protocol.errors import PULL_REF_UNKNOWN, REASON_METADATA_KEY
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows import idpack
from psserver.protocol.rows.init import init_rows
from tests.conftest import P, RawShard
from tests.helpers import refused, wait_until
from tests.integration.test_sparse_rpc import DIM, FP, cluster, close, job, pull_rows, push_rows, rows_chunks, started
from trainer.local.procs import start_shard

ONE_CHUNK = 1 << 20


def remembered_pull(raw, ids, rank=0, packed=True):
    """A PullRows the shard remembers: (version, rows, reference)."""
    t = torch.tensor(ids, dtype=torch.int64)
    req = pb.PullRowsRequest(rank=rank, trainer_id=f"t{rank}", fingerprint=FP, table="emb", remember=True)
    if packed:
        req.packed_ids = idpack.pack(t)
    else:
        req.ids = t.numpy().tobytes()
    chunks = list(raw.stub.PullRows(req, timeout=10))
    rows = torch.frombuffer(bytearray(b"".join(c.rows for c in chunks)), dtype=torch.float32).view(-1, DIM)
    return chunks[0].header.version, rows, chunks[0].header.pull_ref


def named_push(ids, refs, extra=(), grads=None, **kw):
    """PushRows chunks naming ``refs`` (and ``extra`` ids) instead of carrying ids."""
    chunks = rows_chunks(ids, grads, **kw)
    for c in chunks:
        c.ids = b""
    chunks[0].header.pull_refs.extend(refs)
    if extra:
        chunks[0].header.extra_ids = idpack.pack(torch.tensor(extra, dtype=torch.int64))
    return chunks


def test_a_push_naming_its_pull_updates_the_rows_of_that_pulls_ids(shard_server):
    raw = started(shard_server, mode="async")
    version, rows, ref = remembered_pull(raw, [3, 8])
    assert ref != 0 and version == 0
    grads = torch.arange(3 * DIM, dtype=torch.float32).view(3, DIM)
    reply = push_rows(raw, named_push([3, 5, 8], [ref], extra=[5], grads=grads))
    assert reply.outcome == pb.APPLIED and reply.rows_applied == 3
    before = init_rows(job().tables[0].initializer, 7, torch.tensor([3, 5, 8]), DIM)
    assert torch.allclose(pull_rows(raw, [3, 5, 8])[1], before - 0.1 * grads, atol=1e-6)
    counters = raw.stats().counters
    assert counters["pull_refs_resolved"] == 1 and counters["pull_refs_held"] == 1
    assert counters["memory_pull_refs_bytes"] == 16


def test_a_push_naming_one_pull_whole_is_applied_without_a_second_id_check_and_counted_trusted(shard_server):
    raw = started(shard_server, mode="async")
    _, _, ref = remembered_pull(raw, [3, 8])
    grads = torch.ones(2, DIM)
    reply = push_rows(raw, named_push([3, 8], [ref], grads=grads))
    assert reply.outcome == pb.APPLIED and reply.rows_applied == 2
    before = init_rows(job().tables[0].initializer, 7, torch.tensor([3, 8]), DIM)
    assert torch.allclose(pull_rows(raw, [3, 8])[1], before - 0.1 * grads, atol=1e-6)
    _, _, ref2 = remembered_pull(raw, [4, 9])
    push_rows(raw, named_push([4, 5, 9], [ref2], extra=[5]))  # extra ids: checked again, not trusted
    assert raw.stats().counters["pull_refs_trusted"] == 1


def test_a_retried_push_naming_the_same_pull_is_a_duplicate_and_changes_nothing(shard_server):
    raw = started(shard_server, mode="async")
    _, _, ref = remembered_pull(raw, [1, 2])
    assert push_rows(raw, named_push([1, 2], [ref])).outcome == pb.APPLIED
    after = raw.digest()
    again = push_rows(raw, named_push([1, 2], [ref]))  # the reply was "lost": same sequence, same reference
    assert (again.outcome, again.version) == (pb.DUPLICATE, 1) and raw.digest() == after


def _bogus_ref(raw, ref):
    return named_push([1, 2], [ref ^ 0xFFFF])


def _ids_beside_refs(raw, ref):
    chunks = named_push([1, 2], [ref])
    chunks[0].ids = torch.tensor([1, 2]).numpy().tobytes()
    return chunks


def _count_off(raw, ref):
    return named_push([1, 2], [ref], num_ids=3)


def _extra_without_refs(raw, ref):
    chunks = rows_chunks([1, 2])
    chunks[0].header.extra_ids = idpack.pack(torch.tensor([7]))
    return chunks


def _other_trainers_ref(raw, ref):
    _, _, theirs = remembered_pull(raw, [1, 2], rank=1)
    return named_push([1, 2], [theirs])


def _extra_truncated(raw, ref):
    chunks = named_push([1, 2, 9], [ref])
    chunks[0].header.extra_ids = b"\x89"
    return chunks


PUSH_REFUSALS = {
    "unknown reference": (_bogus_ref, "pull_refs names 0x", "held for it: 0x"),
    "another trainer's reference": (_other_trainers_ref, "pull_refs names 0x", "rank 0"),
    "ids beside references": (_ids_beside_refs, "16 bytes of ids and 32 of rows", "names pull_refs"),
    "count off": (_count_off, "num_ids is 3 but pull_refs and extra_ids name 2 ids"),
    "extra ids without references": (_extra_without_refs, "extra_ids holds 1 bytes but pull_refs is empty"),
    "extra ids truncated": (_extra_truncated, "packed_extra_ids", "end inside a varint"),
}


@pytest.mark.parametrize("case", PUSH_REFUSALS)
def test_a_push_naming_pulls_badly_is_refused_invalid_argument_and_changes_nothing(shard_server, case):
    raw = started(shard_server, num_trainers=2, num_embeddings=100)
    raw.register(rank=1, spec=job(num_trainers=2, num_embeddings=100))
    assert push_rows(raw, rows_chunks([5, 6])).outcome == pb.ACCEPTED  # an open round the refusal must not touch
    _, _, ref = remembered_pull(raw, [1, 2])
    spoil, *fragments = PUSH_REFUSALS[case]
    chunks = spoil(raw, ref)
    error = refused(lambda: push_rows(raw, chunks), grpc.StatusCode.INVALID_ARGUMENT, *fragments, unchanged=raw)
    reason = dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY)
    assert (reason == PULL_REF_UNKNOWN) == (case in ("unknown reference", "another trainer's reference"))
    assert pull_rows(raw, [1, 2])[0] == 0  # still serving
    assert push_rows(raw, named_push([1, 2], [ref], seq=1, rank=0, base=0)).outcome == pb.DUPLICATE


PULL_REFUSALS = {
    "both ids and packed ids": (dict(ids=b"\0" * 8, packed_ids=b"\x01"), "ids (8 bytes) and packed_ids (1 bytes)"),
    "packed ids repeat": (dict(packed_ids=b"\x04\x00"), "packed_ids", "repeats id 0"),
    "packed ids truncated": (dict(packed_ids=b"\x84"), "packed_ids", "end inside a varint"),
}


@pytest.mark.parametrize("case", PULL_REFUSALS)
def test_a_pull_with_bad_packed_ids_is_refused_and_creates_no_row(shard_server, case):
    raw = started(shard_server)
    fields, *fragments = PULL_REFUSALS[case]
    req = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="emb", remember=True, **fields)
    refused(lambda: list(raw.stub.PullRows(req, timeout=10)), grpc.StatusCode.INVALID_ARGUMENT, *fragments,
            unchanged=raw)
    assert raw.stats().counters["table.emb.live_rows"] == 0 and raw.stats().counters["pull_refs_held"] == 0
    assert remembered_pull(raw, [1])[2] != 0  # still serving


def test_a_trainer_resends_with_its_ids_a_push_whose_pull_the_shard_no_longer_holds(shard_server):
    spec = job(num_shards=2, mode="async")
    raws, trainers = cluster(shard_server, spec)
    rows = trainers[0][1]
    try:
        ids = torch.arange(40)
        start = rows.pull("emb", ids)
        rows.push("emb", ids, torch.ones(40, DIM), 1)
        assert rows.counters["pushes_naming_pulls"] == 2 and rows.counters["pull_refs_refused"] == 0
        rows.pull("emb", ids)
        for s, pos in enumerate(rows.split(ids)):  # pulls the shards do not hold (as after their own bound)
            book = rows.book.lanes[(s, "emb")].refs
            book.forget()
            book.record(0x7E57 << 32 | 1, ids[pos[:3]])
        rows.push("emb", ids, torch.ones(40, DIM), 1)
        assert rows.counters["pull_refs_refused"] == 2  # counted, and sent again with their ids
        assert rows.counters["pushes_naming_pulls"] == 2  # (the resent ones named nothing)
        assert rows.versions() == {"emb": [2, 2]}  # each push applied exactly once on each shard
        assert torch.allclose(rows.pull("emb", ids), start - 0.2)
    finally:
        close(trainers)


def test_after_kill_9_and_restore_a_reference_from_before_is_refused_and_the_ids_retry_is_a_duplicate(tmp_path):
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=args)
    procs = [shard]
    try:
        spec = job(mode="async")
        with RawShard(SimpleNamespace(address=shard.address)) as raw:
            raw.register(spec=spec)
            raw.init(torch.arange(P, dtype=torch.float32), chunk_bytes=ONE_CHUNK)
            _, _, ref = remembered_pull(raw, [3, 4])
            assert push_rows(raw, named_push([3, 4], [ref])).outcome == pb.APPLIED
            raw.push(torch.ones(P), sequence=1, chunk_bytes=ONE_CHUNK)  # a dense step: a checkpoint
            wait_until(lambda: raw.stub.GetStats(pb.StatsRequest(), timeout=10).counters["checkpoints_written"] >= 1,
                       "a checkpoint")
            digest = raw.digest()
        shard.kill()
        restarted = start_shard(0, tmp_path / "shard0-restarted.log", port=int(shard.address.rsplit(":", 1)[1]),
                                extra_args=args + ["--restore"])
        procs.append(restarted)
        with RawShard(SimpleNamespace(address=restarted.address)) as raw:
            assert raw.digest() == digest
            remembered_pull(raw, [5, 6])  # the new process gives references of its own (and creates two rows)
            digest = raw.digest()
            error = refused(lambda: push_rows(raw, named_push([3, 4], [ref])), grpc.StatusCode.INVALID_ARGUMENT,
                            f"pull_refs names {ref:#x}", unchanged=raw)
            assert dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY) == PULL_REF_UNKNOWN
            again = push_rows(raw, rows_chunks([3, 4]))  # the same push with its ids: applied before the kill
            assert (again.outcome, again.version) == (pb.DUPLICATE, 1) and raw.digest() == digest
    finally:
        for p in procs:
            p.kill()


def _step_call_trainer(addresses: str, plant_at: int | None) -> tuple[dict, dict]:
    """One sync trainer with prefetch (one Step a shard a step, tests/integration/test_step_call.py); before step
    ``plant_at`` every lane names only a pull its shard never gave.  (counters, final rows and dense weights)."""
    from tests.integration.test_row_prefetch import B, STEPS, Rec, batch
    from trainer.stepping.api import connect

    torch.manual_seed(0)
    model = Rec("adagrad")
    with connect(addresses, model, mode="sync", optimizer={"name": "sgd", "lr": 0.1}, retry_budget=60.0) as ps:
        batches = ps.prefetching([batch(0, k) for k in range(STEPS)], forward=lambda m, b: m(*b[:3]))
        for k, (users, items, regions, y) in enumerate(batches):
            ((model(users, items, regions) - y).pow(2).mean()).backward()
            if k == plant_at:
                for (_, table), lane in ps.rows.book.lanes.items():
                    pulled = [ids for _, ids in lane.refs._kept]
                    lane.refs.forget()
                    for ids in pulled:
                        lane.refs.record(0x7E57 << 32 | 1, ids)  # the same ids under a reference never given
            ps.step(num_samples=B)
        out = {n: ps.rows.pull(n, torch.arange(40)) for n in ("user", "item")}
        out.update({k: v.clone() for k, v in model.state_dict().items()})
        return dict(ps.counters), out


def test_a_step_call_naming_a_pull_the_shard_never_gave_falls_back_resends_the_ids_and_ends_with_the_same_bits(
        shard_server):
    clean_counters, clean = _step_call_trainer(",".join(shard_server(shard=i).server.address for i in range(2)), None)
    counters, planted = _step_call_trainer(",".join(shard_server(shard=i).server.address for i in range(2)), 3)
    assert clean_counters["rows_pushes_naming_pulls"] > 0 and clean_counters.get("rows_pull_refs_refused", 0) == 0
    assert counters["rows_pull_refs_refused"] >= 1 and counters["step_calls_fallen_back"] >= 1
    for name, value in clean.items():
        assert torch.equal(planted[name], value), name


def test_a_step_calls_pushes_naming_their_pulls_are_trusted_as_checked_on_every_shard(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    counters, _ = _step_call_trainer(",".join(s.server.address for s in shards), None)
    assert counters["rows_pushes_naming_pulls"] > 0 and counters.get("rows_pull_refs_refused", 0) == 0
    for s in shards:  # (GetStats without a digest answers anyone)
        c = s.stats().counters
        assert c["pull_refs_trusted"] > 0 and c["pull_refs_trusted"] <= c["pull_refs_resolved"]
