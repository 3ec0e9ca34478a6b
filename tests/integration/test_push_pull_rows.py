"""PushPullRows against real shards on loopback: a push and the next batch's pull in one call -- the rows of the
round's close, exactly once under a lost reply, and refusals of its pull fields that change nothing."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from psserver.protocol import limits
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.placement import shard_of
from tests.helpers import refused, wait_until
from tests.integration.switchproxy import SwitchProxy
from tests.integration.test_sparse_rpc import DIM, FP, job, pull_rows, rows_chunks, started
from trainer.channels.client import RetryPolicy, ShardedClient
from trainer.tables.sparse_client import ShardedRows


def push_pull(raw, chunks, pull_ids=None, raw_pull_ids=None):
    """(push reply, rows version, rows) of one PushPullRows."""
    chunks[0].header.pull_ids = raw_pull_ids if raw_pull_ids is not None else \
        torch.tensor(pull_ids, dtype=torch.int64).numpy().tobytes()
    replies = list(raw.stub.PushPullRows(iter(chunks), timeout=10))
    h = replies[0].header
    data = b"".join(c.rows for c in replies)
    return h.push, h.version, torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, DIM)


def test_the_reply_carries_the_rows_of_the_round_this_push_closed(shard_server):
    raw = started(shard_server, num_trainers=2)
    out = {}
    waiting = threading.Thread(target=lambda: out.update(r0=push_pull(raw, rows_chunks([1, 2]), [1, 2, 3])))
    waiting.start()  # rank 0's call waits for the round's close, as a PullRows with min_version 1 would
    wait_until(lambda: raw.stats().counters["row_pushes"] == 1, "rank 0's push to be accepted")
    raw.register(rank=1, spec=job(num_trainers=2))
    reply, version, rows = push_pull(raw, rows_chunks([2], rank=1), [1, 2, 3])
    waiting.join(timeout=30)
    assert reply.outcome == pb.APPLIED and version == 1
    assert out["r0"][0].outcome == pb.ACCEPTED and out["r0"][1] == 1
    fresh = pull_rows(raw, [1, 2, 3], min_version=1)
    assert torch.equal(out["r0"][2], fresh[1]) and torch.equal(rows, fresh[1])


def test_a_retry_with_the_same_sequence_applies_nothing_twice_and_still_answers_the_rows(shard_server):
    raw = started(shard_server)
    first = push_pull(raw, rows_chunks([1, 2]), [1, 2, 5])
    after = raw.digest()
    again = push_pull(raw, rows_chunks([1, 2]), [1, 2, 5])  # its reply was "lost": the same sequence again
    assert first[0].outcome == pb.APPLIED and again[0].outcome == pb.DUPLICATE
    assert raw.digest() == after and raw.stats().counters["table.emb.pushes_duplicate"] == 1
    assert again[1] == first[1] == 1 and torch.equal(again[2], first[2])


def test_a_lost_reply_through_a_proxy_is_retried_once_applied_once_and_its_rows_reach_the_forward(shard_server):
    spec = job(mode="sync")
    raw = shard_server()
    proxy = SwitchProxy(raw.server.address)
    client = ShardedClient([proxy.address], spec, 0, "t0", retry=RetryPolicy(budget_seconds=30))
    rows = ShardedRows(client, spec)
    try:
        client.shards[0].registrar.register(spec, connect_timeout=10)
        ids = torch.tensor([1, 2, 3])
        rows.pull("emb", ids)
        rows.prefetch("emb", torch.tensor([2, 3, 4]), ahead=1)
        proxy.swallow_replies()
        pushing = threading.Thread(target=rows.push, args=("emb", ids, torch.ones(3, DIM), 1))
        pushing.start()
        wait_until(lambda: raw.stats().counters["table.emb.pushes_applied"] == 1, "the push to be applied")
        proxy.forward()  # the connection that lost the reply is reset: the call is retried under its number
        pushing.join(timeout=60)
        assert not pushing.is_alive()
        c = raw.stats().counters
        assert c["table.emb.pushes_applied"] == 1 and c["table.emb.pushes_duplicate"] == 1
        assert c["row_push_pulls"] == 2 and c.get("row_pulls", 0) == 3  # 1 forward pull + the fused call's 2
        got = rows.pull("emb", torch.tensor([2, 3, 4]))  # from the fused reply: no call
        assert rows.counters["prefetch_hits"] == 3 and rows.counters["fused_pulls"] == 1
        assert raw.stats().counters["row_pulls"] == 3
        assert torch.equal(got, pull_rows(raw, [2, 3, 4], min_version=1)[1])
    finally:
        rows.close()
        client.close()
        proxy.close()


def _foreign() -> int:
    return next(i for i in range(100) if int(shard_of(torch.tensor([i]), 2)) == 1)


PULL_FIELD_REFUSALS = {
    "pull ids not 8 bytes": (dict(raw_pull_ids=b"\0" * 12), grpc.StatusCode.INVALID_ARGUMENT,
                             "12 bytes, not a multiple of 8"),
    "repeated pull ids": (dict(pull_ids=[4, 4]), grpc.StatusCode.INVALID_ARGUMENT, "id 4 appears 2 times"),
    "pull id out of range": (dict(pull_ids=[100]), grpc.StatusCode.INVALID_ARGUMENT, "id 100 is out of range"),
    "over the id cap": (dict(raw_pull_ids=b"\0" * 8 * (limits.MAX_IDS_PER_CALL + 1)),
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limits.MAX_IDS_PER_CALL + 1} entries, over the limit"),
    "not a member": (dict(pull_ids=[1], rank=1), grpc.StatusCode.NOT_FOUND, "rank 1 is not registered"),
    "unknown table": (dict(pull_ids=[1], table_name="nope"), grpc.StatusCode.INVALID_ARGUMENT, "table is 'nope'"),
}


@pytest.mark.parametrize("case", PULL_FIELD_REFUSALS)
def test_a_refused_push_pull_changes_no_state_and_the_shard_goes_on_serving(shard_server, case):
    raw = started(shard_server, num_trainers=2, num_embeddings=100)
    assert raw.stub.PushRows(iter(rows_chunks([1, 2])), timeout=10).outcome == pb.ACCEPTED  # an open round
    before = raw.digest()
    kw = dict(PULL_FIELD_REFUSALS[case][0])
    pull = {k: kw.pop(k) for k in ("pull_ids", "raw_pull_ids") if k in kw}
    refused(lambda: push_pull(raw, rows_chunks([8, 9], seq=2, **kw), **pull), *PULL_FIELD_REFUSALS[case][1:])
    assert raw.digest() == before
    assert pull_rows(raw, [1, 2])[0] == 0  # still serving


def test_a_pull_id_of_another_shard_is_refused_before_the_push_is_applied(shard_server):
    raw = shard_server(shard=0)
    raw.register(spec=job(num_shards=2))
    before = raw.digest()
    refused(lambda: push_pull(raw, rows_chunks([]), [_foreign()]), grpc.StatusCode.INVALID_ARGUMENT,
            f"id {_foreign()} lives on shard 1", unchanged=raw)
    assert raw.digest() == before and raw.stats().counters.get("table.emb.pushes_applied", 0) == 0


def test_a_reply_past_the_byte_limit_is_refused_before_the_push_is_applied(shard_server):
    raw = shard_server(max_push_bytes=1024)
    raw.register(spec=job())
    before = raw.digest()
    refused(lambda: push_pull(raw, rows_chunks([1]), list(range(100))), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "100 rows of dim 4", "over this shard's limit of 1024")
    assert raw.digest() == before and raw.stats().counters["table.emb.live_rows"] == 0
    assert push_pull(raw, rows_chunks([1]), [1])[0].outcome == pb.APPLIED  # still serving
