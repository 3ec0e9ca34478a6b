"""The Step RPC with an async table beside a sync dense slice, against a real shard on loopback: a table part that
carries the next batch's ids is answered at once with the rows after its push (what the trainer's folded prefetch
relies on), and a refusal of such a part -- or of any part beside it -- changes nothing."""

from __future__ import annotations

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_sparse_rpc import job, rows_chunks
from tests.integration.test_step_rpc import dense, rows, step, table_reply, weights


def started(shard_server):
    """A shard of a sync job whose table ``emb`` is async, registered and initialised."""
    raw = shard_server()
    raw.register(spec=job(num_embeddings=100, mode="async"))
    raw.init(torch.zeros(P))
    return raw


def test_an_async_table_part_with_next_ids_is_answered_at_once_with_the_rows_after_its_push(shard_server):
    raw = started(shard_server)
    before = table_reply(step(raw, rows(0, rows_chunks([9]), [1, 2]))[0])[2]  # rows 1, 2 as they are
    out = step(raw, dense(raw, torch.ones(P)) + rows(1, rows_chunks([1], seq=2), [1, 2]))
    push, version, pulled = table_reply(out[1])
    assert push.outcome == pb.APPLIED and version == push.version == 2  # answered at the version after the push
    assert not torch.equal(pulled[0], before[0]) and torch.equal(pulled[1], before[1])  # row 1 pushed, 2 not
    assert weights(out[0])[0].outcome == pb.APPLIED


CASES = {
    "repeated pull ids": (lambda raw: dense(raw, torch.ones(P)) + rows(1, rows_chunks([1]), [4, 4]),
                          "id 4 appears 2 times"),
    "repeated push ids": (lambda raw: dense(raw, torch.ones(P)) + rows(1, rows_chunks([3, 3]), [1]),
                          "id 3 appears 2 times"),
    "a dense part of the wrong dtype": (lambda raw: dense(raw, torch.ones(P), dtype=pb.BFLOAT16)
                                        + rows(1, rows_chunks([1]), [1]), "dtype is bfloat16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_step_with_an_async_table_part_changes_no_state_and_the_shard_goes_on(shard_server, case):
    raw = started(shard_server)
    msgs, fragment = CASES[case]
    refused(lambda: step(raw, msgs(raw)), grpc.StatusCode.INVALID_ARGUMENT, fragment, unchanged=raw)
    assert raw.stats().counters.get("table.emb.pushes_applied", 0) == 0 and raw.stats().version == 0
    after = step(raw, dense(raw, torch.ones(P)) + rows(1, rows_chunks([1]), [1]))  # still serving
    assert weights(after[0])[0].outcome == pb.APPLIED and table_reply(after[1])[0].outcome == pb.APPLIED
