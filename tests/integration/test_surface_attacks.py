"""An attacker's pass over the shard's other newer surfaces, over real gRPC: an async table's push window (numbers
far ahead, many holes, a hole fallen out of the window) and the data cursor's ClaimBatch (a release then more
claims, a batches_per_epoch past its cap).  What was found here was already refused as the contract says; these
tests keep it so.  Each refusal: one status, a message naming the field and both values, the shard's state digest
unchanged, and the shard still serving."""

from __future__ import annotations

import grpc
import torch

from psserver.members.data_cursor import MAX_BATCHES_PER_EPOCH
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_data_cursor_wire import ASYNC, claim
from tests.integration.test_sparse_rpc import job, push_rows, rows_chunks

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_async_table_pushes_far_ahead_or_behind_the_window_are_refused_and_holes_stay_bounded(shard_server):
    raw = shard_server()
    raw.register(spec=job(mode="async"))
    assert push_rows(raw, rows_chunks([1], seq=1)).outcome == pb.APPLIED
    far = 1 + (1 << 20) + 1
    refused(lambda: push_rows(raw, rows_chunks([1], seq=far)), INVALID,
            f"sequence is {far} but rank 0's last acknowledged push to table 'emb' was 1", unchanged=raw)
    assert push_rows(raw, rows_chunks([1], seq=200)).outcome == pb.APPLIED  # 2..199 skipped: 137..199 kept as holes
    refused(lambda: push_rows(raw, rows_chunks([1], seq=100)), INVALID,
            "sequence is 100 but rank 0's last acknowledged push to table 'emb' was 200", "63 before it", unchanged=raw)
    assert push_rows(raw, rows_chunks([1], seq=150)).outcome == pb.APPLIED  # a hole: applied once
    assert push_rows(raw, rows_chunks([1], seq=150)).outcome == pb.DUPLICATE
    refused(lambda: push_rows(raw, rows_chunks([1], seq=(1 << 64) - 1)), INVALID,
            f"sequence is {(1 << 64) - 1}, over the limit of {1 << 48}", unchanged=raw)
    assert push_rows(raw, rows_chunks([1], seq=201)).outcome == pb.APPLIED


def test_a_claim_after_a_release_is_granted_a_new_batch_and_the_release_is_not_retried_after_it(shard_server):
    raw = shard_server()
    raw.register(spec=ASYNC)
    raw.register(rank=1, spec=ASYNC)
    raw.init(torch.zeros(P))
    assert (claim(raw, 1).batch, claim(raw, 1).granted) == (0, True)
    assert not claim(raw, 2, release=True).granted
    again = claim(raw, 3)
    assert (again.batch, again.granted, again.reissued) == (1, True, False)  # the released batch 0 was trained
    refused(lambda: claim(raw, 2, release=True), INVALID, "claim is 2 but rank 0's next claim is 4 (or 3, a retry)",
            unchanged=raw)
    refused(lambda: claim(raw, 1, rank=1, per_epoch=(1 << 64) - 1), INVALID,
            f"batches_per_epoch is {(1 << 64) - 1} but must be 1..{MAX_BATCHES_PER_EPOCH}", unchanged=raw)
    assert claim(raw, 1, rank=1).batch == 2
