"""A push that announces the trainer's leave (ChunkHeader.leaving) on a Shard whose clock the test holds: the
rank is out of the epoch from the round after the push's, before that round is served; what is not carried
out (a duplicate, a refusal) changes no epoch.  The cluster test (tests/cluster/test_elastic.py) shows the
data it saves: the others split the next round without the leaver."""

import pytest
import torch

from psserver.partition.shard import Shard
from psserver.protocol.errors import FutureVersion
from tests.conftest import P, make_spec

FP = "f" * 16


def three(clock=lambda: 100.0) -> Shard:
    shard = Shard(0, clock=clock, lease_timeout=600.0)
    spec = make_spec(num_trainers=3, max_trainers=3)
    for r in range(3):
        shard.register(r, f"t{r}", 0, spec)
    shard.init(0, "t0", FP, torch.zeros(P))
    return shard


def members(shard: Shard) -> list[tuple[int, list[int]]]:
    return [(e.round, sorted(e.members)) for e in shard.admission.epoch_timeline()]


def test_a_leaving_push_takes_the_rank_out_from_the_next_round_which_then_closes_without_it():
    shard = three()
    shard.push(0, "t0", FP, 0, 1, torch.ones(P), 1)
    shard.push(1, "t1", FP, 0, 1, torch.ones(P), 1, leaving=True)
    assert members(shard) == [(0, [0, 1, 2]), (1, [0, 2])] and shard.version == 0  # round 0 still waits for 2
    assert shard.push(2, "t2", FP, 0, 1, torch.ones(P), 1)[0].outcome == "applied"
    assert shard.admission.epoch_number(1) == shard.admission.epoch_timeline()[1].number  # version 1 is served with the new epoch
    shard.push(0, "t0", FP, 1, 1, torch.ones(P), 2)
    assert shard.push(2, "t2", FP, 1, 1, torch.ones(P), 2)[0].outcome == "applied"  # no wait for rank 1
    counters = shard.snapshot().counters
    assert counters["leaves_announced"] == 1 and counters["rounds_all_arrived"] == 2
    assert counters.get("rounds_membership", 0) == 0
    shard.leave(1, "t1", FP)  # the Leave that follows changes no epoch again
    assert members(shard) == [(0, [0, 1, 2]), (1, [0, 2])]


def test_a_leaving_push_sent_again_after_a_lost_reply_changes_nothing_more():
    shard = three()
    shard.push(1, "t1", FP, 0, 1, torch.ones(P), 1, leaving=True)
    before, digest = members(shard), shard.state_digest()
    assert shard.push(1, "t1", FP, 0, 1, torch.ones(P), 1, leaving=True)[0].outcome == "duplicate"
    assert members(shard) == before and shard.state_digest() == digest
    assert shard.snapshot().counters["leaves_announced"] == 1


def test_a_refused_leaving_push_changes_no_epoch():
    shard = three()
    with pytest.raises(FutureVersion):
        shard.push(1, "t1", FP, 5, 1, torch.ones(P), 1, leaving=True)
    assert members(shard) == [(0, [0, 1, 2])]
    assert shard.snapshot().counters.get("leaves_announced", 0) == 0
