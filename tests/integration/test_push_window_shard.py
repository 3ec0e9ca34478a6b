"""A shard's exactly-once over a window of sequence numbers, on the wire: pushes that overtake each other are
each applied once, their retries are duplicates, and a number older than the window is refused unchanged."""

import grpc
import torch

from psserver.protocol.limits import MAX_PUSH_WINDOW
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, make_spec
from tests.helpers import refused


def started_async(shard_server):
    shard = shard_server()
    shard.register(spec=make_spec(mode="async"))
    shard.init(torch.zeros(P))
    return shard


def test_pushes_that_overtook_each_other_are_applied_once_each_and_their_retries_are_duplicates(shard_server):
    shard = started_async(shard_server)
    assert shard.push(torch.ones(P), sequence=3).outcome == pb.APPLIED  # 3 overtook 1 and 2
    assert shard.push(torch.ones(P), sequence=1).outcome == pb.APPLIED
    assert shard.push(torch.ones(P), version=2, sequence=2).outcome == pb.APPLIED
    before = shard.digest()
    for seq in (1, 2, 3):  # every reply "lost": each sent again
        assert shard.push(torch.ones(P), sequence=seq).outcome == pb.DUPLICATE
    assert shard.digest() == before
    c = shard.stats().counters
    assert (c["pushes_applied"], c["duplicates"], shard.stats().version) == (3, 3, 3)


def test_a_sequence_older_than_the_window_is_refused_naming_both_and_changes_nothing(shard_server):
    shard = started_async(shard_server)
    newest = MAX_PUSH_WINDOW + 5  # 5 is the 64th number before it, just out of the window; 6 is in it
    shard.push(torch.ones(P), sequence=newest)
    before = shard.digest()
    refused(lambda: shard.push(torch.ones(P), version=1, sequence=5), grpc.StatusCode.INVALID_ARGUMENT,
            f"sequence is 5 but rank 0's last acknowledged push was {newest}",
            f"one of the {MAX_PUSH_WINDOW - 1} before it still in flight")
    assert shard.digest() == before
    assert shard.push(torch.ones(P), version=1, sequence=6).outcome == pb.APPLIED  # a hole: still served, once
