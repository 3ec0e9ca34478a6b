"""A silent trainer's lease on a Shard whose clock the test holds: what closes the round it held up, and when.

The cluster test (tests/cluster/test_membership.py) shows the same with real
processes, where the machine's load decides the timing; here the silence is
certain and the clock moves only when the test says, so the counts are exact.
"""

import torch

from psserver.partition.shard import Shard
from tests.conftest import P, make_spec

FP = "f" * 16
LEASE = 2.0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sync_pair(clock: Clock) -> Shard:
    """A sync job of two trainers, initialised; rank 0 has pushed into round 0, rank 1 has said nothing since it
    registered at time 100."""
    shard = Shard(0, clock=clock, lease_timeout=LEASE)
    spec = make_spec(num_trainers=2)
    shard.register(0, "t0", 0, spec)
    shard.register(1, "t1", 0, spec)
    clock.now += 1.0
    shard.init(0, "t0", FP, torch.zeros(P))
    assert shard.push(0, "t0", FP, 0, 1, torch.ones(P), 1)[0].outcome == "accepted"
    return shard


def test_the_round_a_silent_trainer_holds_up_closes_by_membership_when_its_lease_runs_out():
    clock = Clock()
    shard = sync_pair(clock)
    clock.now = 100.0 + LEASE  # rank 1 silent exactly the lease: not yet expired
    shard.tick()
    assert shard.version == 0 and shard.snapshot().live_ranks == [0, 1]
    clock.now = 100.0 + LEASE + 0.01  # rank 1 past its lease; rank 0 (heard at 101) is not
    shard.tick()
    stats = shard.snapshot()
    assert stats.live_ranks == [0] and stats.version == 1
    assert stats.counters["lease_expired"] == 1
    assert stats.counters["rounds_membership"] == 1 and stats.counters.get("rounds_all_arrived", 0) == 0
    # rank 0 alone now: its next push closes the round by arrival
    assert shard.push(0, "t0", FP, 1, 1, torch.ones(P), 2)[0].outcome == "applied"
    assert shard.snapshot().counters["rounds_all_arrived"] == 1


def test_a_trainer_heard_from_again_after_its_lease_is_live_and_its_rounds_wait_for_it_again():
    clock = Clock()
    shard = sync_pair(clock)
    clock.now = 100.0 + LEASE + 0.01
    shard.tick()  # rank 1 dropped; round 0 closed without it
    shard.heartbeat(1, "t1", FP)
    stats = shard.snapshot()
    assert stats.live_ranks == [0, 1] and stats.counters["rejoins"] == 1
    assert shard.push(0, "t0", FP, 1, 1, torch.ones(P), 2)[0].outcome == "accepted"  # round 1 waits for rank 1
    assert shard.push(1, "t1", FP, 1, 1, torch.ones(P), 1)[0].outcome == "applied"
    assert shard.snapshot().counters["rounds_all_arrived"] == 1
