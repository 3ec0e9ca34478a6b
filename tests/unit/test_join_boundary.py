"""Where a join takes effect, across shards, as pure decisions on a fake clock (psserver.members.epochs + psserver.state.modes).

Two simulated shards of one sync job run the same decisions a real shard runs (EpochBook for the timeline,
modes.decide_push / decide_tick for the rounds); the test plays the joiner's messages between the trainers'
pushes.  What every scenario checks: every shard admits the joiner at the same round E (so no round mixes two
epochs), no shard serves version E before it knows the new epoch, the round open at a shard when the join
reached it is never held, and E is JOIN_LEAD rounds after the round open at the joiner's first Register
(docs/design/elastic-join.md says why one round is not possible without holding an open round).
"""

from __future__ import annotations

import pytest

from psserver.members.epochs import EpochBook
from psserver.protocol.epochs import JOIN_LEAD, MAX_JOIN_AHEAD
from psserver.protocol.errors import JobMismatch
from psserver.state import modes

CFG = modes.ModeConfig("sync")
PATIENCE = 3.0


class SimShard:
    """One shard's version, open round and timeline: pushes close rounds as modes decides."""

    def __init__(self, name: str, members=(0, 1)):
        self.book = EpochBook(len(members), 4, name)
        self.version, self.contributors, self.opened_at = 0, set(), None
        self.live = set(members)
        self.served_with: dict[int, frozenset] = {}  # version -> the members its pulls told (what it was served as)

    def view(self) -> modes.RoundView:
        held = self.book.held_from()
        return modes.RoundView(version=self.version, live=self.book.expected(frozenset(self.live), self.version),
                               held=held is not None and self.version >= held, contributors=frozenset(self.contributors),
                               members=len(self.book.members_at(self.version)), opened_at=self.opened_at)

    def push(self, rank: int, now: float = 0.0) -> None:
        d = modes.decide_push(CFG, self.view(), rank, self.version, now)
        assert d.action is modes.Action.ACCUMULATE, d
        self.contributors.add(rank)
        self.opened_at = now if self.opened_at is None else self.opened_at
        if d.close:
            self._close()

    def tick(self, now: float = 0.0) -> None:
        self.book.expire(now)
        if modes.decide_tick(CFG, self.view(), now):
            self._close()

    def open_round_held(self) -> bool:
        return self.view().held

    def _close(self) -> None:
        self.version += 1
        self.contributors, self.opened_at = set(), None
        self.served_with[self.version] = self.book.members_at(self.version)


def step(shards, ranks=(0, 1)) -> None:
    """Every rank pushes the round open on every shard (a round in which nothing is held)."""
    for s in shards:
        for r in ranks:
            s.push(r)


def prepare_everywhere(shards, trainer_id: str, now: float = 0.0) -> tuple[int, int]:
    """The joiner's first Register: shard 0 hands out the rank, the others are told it.  Returns (rank, E)."""
    head = shards[0].book.prepare(None, trainer_id, shards[0].version, now, PATIENCE)
    rank = shards[0].book.rank_of(trainer_id)
    proposals = [head.proposal] + [s.book.prepare(rank, trainer_id, s.version, now, PATIENCE).proposal
                                   for s in shards[1:]]
    return rank, max(proposals)


def commit_everywhere(shards, rank: int, trainer_id: str, join_round: int) -> None:
    for s in shards:
        s.book.commit(rank, trainer_id, join_round, s.version)
        s.live.add(rank)
    for s in shards:
        s.book.confirm(rank, trainer_id, join_round, s.version)
        s.tick()  # a held round that is complete closes once the join is settled


def assert_one_boundary(shards, rank: int, join_round: int) -> None:
    """Same timeline by round on every shard; version join_round served with the joiner in, the one before without."""
    for s in shards:
        assert rank not in s.book.members_at(join_round - 1) and rank in s.book.members_at(join_round)
        assert [(e.round, e.members) for e in s.book.timeline] == [(e.round, e.members) for e in shards[0].book.timeline]
        assert rank not in s.served_with.get(join_round - 1, frozenset())
        assert join_round not in s.served_with or rank in s.served_with[join_round]


def test_a_join_arriving_mid_round_on_skewed_shards_is_admitted_join_lead_rounds_after_the_head_and_never_holds_an_open_round():
    a, b = SimShard("shard 0"), SimShard("shard 1")
    for _ in range(5):
        step([a, b])
    a.push(0), a.push(1), b.push(0)  # shard 0 closed round 5; shard 1 still waits for rank 1's push
    assert (a.version, b.version) == (6, 5)
    opened_at_register = a.version  # the joiner's first Register reaches shard 0 (it hands out the rank) first
    rank, join_round = prepare_everywhere([a, b], "t2")
    assert join_round == max(a.version, b.version) + JOIN_LEAD == opened_at_register + JOIN_LEAD
    assert not a.open_round_held() and not b.open_round_held()  # joining stalls no open round
    b.push(1)  # so shard 1's round 5 closes as usual, in the old epoch
    step([a, b])  # round 6 closes on shard 0; shard 1 holds it (asked at version 5) until the commit
    assert (a.version, b.version) == (7, 6) and b.open_round_held()
    assert all(s.version < join_round <= s.version + MAX_JOIN_AHEAD for s in (a, b))  # the commit is taken everywhere
    commit_everywhere([a, b], rank, "t2", join_round)
    assert (a.version, b.version) == (7, 7)
    step([a, b])  # round 7: the last without the joiner
    step([a, b], ranks=(0, 1, rank))  # round 8 = join_round waits for the joiner
    assert_one_boundary([a, b], rank, join_round)
    assert a.version == b.version == join_round + 1


def test_the_round_after_the_open_one_cannot_close_before_the_commit_so_no_shard_serves_the_join_round_early():
    a, b = SimShard("shard 0"), SimShard("shard 1")
    rank, join_round = prepare_everywhere([a, b], "t2")
    assert join_round == JOIN_LEAD
    step([a, b])  # round 0 (open at the Register) closes
    step([a, b])  # round 1 takes every gradient but is held: version 2 = join_round is not served
    assert a.version == b.version == join_round - 1 and a.open_round_held() and b.open_round_held()
    commit_everywhere([a, b], rank, "t2", join_round)
    assert a.version == b.version == join_round
    assert_one_boundary([a, b], rank, join_round)


def test_two_joins_in_one_round_reaching_the_shards_in_either_order_make_one_epoch_with_both_everywhere():
    a, b = SimShard("shard 0"), SimShard("shard 1")
    step([a, b])
    pa = [a.book.prepare(None, t, a.version, 0.0, PATIENCE) for t in ("ta", "tb")]
    ranks = {t: a.book.rank_of(t) for t in ("ta", "tb")}
    pb = [b.book.prepare(ranks[t], t, b.version, 0.0, PATIENCE) for t in ("tb", "ta")]
    join_round = max(p.proposal for p in pa + pb)
    assert join_round == 1 + JOIN_LEAD and sorted(ranks.values()) == [2, 3]
    for t in ("ta", "tb"):
        a.book.commit(ranks[t], t, join_round, a.version)
    for t in ("tb", "ta"):
        b.book.commit(ranks[t], t, join_round, b.version)
    for t in ("ta", "tb"):
        a.book.confirm(ranks[t], t, join_round, a.version), b.book.confirm(ranks[t], t, join_round, b.version)
    assert a.book.timeline == b.book.timeline  # numbers too: each commit renumbered the same epochs
    assert [(e.round, sorted(e.members)) for e in a.book.timeline] == [(0, [0, 1]), (join_round, [0, 1, 2, 3])]


def test_a_join_during_a_shard_restart_is_taken_by_the_restarted_shard_at_the_same_round_while_it_is_behind():
    a, b = SimShard("shard 0"), SimShard("shard 1")
    for _ in range(3):
        step([a, b])
    checkpoint = (b.version, b.book.state())  # shard 1's checkpoint of its latest round
    rank, join_round = prepare_everywhere([a, b], "t2")
    restarted = SimShard("shard 1")  # shard 1 restarts: the checkpoint has the timeline, not the pending join
    restarted.version = checkpoint[0]
    restarted.book.restore(checkpoint[1])
    assert restarted.book.pending == {} and not restarted.open_round_held()
    step([a, restarted])  # round 3 (open at the Register) closes on both
    commit_everywhere([a, restarted], rank, "t2", join_round)  # still below join_round: taken without a prepare
    step([a, restarted])
    assert a.version == restarted.version == join_round
    assert_one_boundary([a, restarted], rank, join_round)


def same_members_served(shards, upto: int) -> bool:
    """Every round up to ``upto`` expects the same members on every shard, and every version both served was
    served with the same members (no round's data split on one shard's word)."""
    first = shards[0]
    rounds_agree = all(s.book.members_at(r) == first.book.members_at(r) for s in shards for r in range(upto + 1))
    served = all(s.served_with[v] == first.served_with[v] for s in shards for v in s.served_with
                 if v in first.served_with)
    return rounds_agree and served


def test_a_join_during_a_shard_restart_that_served_the_join_round_is_refused_withdrawn_unserved_and_joins_again():
    a, b = SimShard("shard 0"), SimShard("shard 1")
    for _ in range(3):
        step([a, b])
    checkpoint = (b.version, b.book.state())
    rank, join_round = prepare_everywhere([a, b], "t2")
    restarted = SimShard("shard 1")  # shard 1 restarts: the pending join, and its hold, are gone
    restarted.version = checkpoint[0]
    restarted.book.restore(checkpoint[1])
    step([a, restarted])  # round 3 (open at the Register) closes on both
    step([a, restarted])  # round 4: shard 0 holds it for the join; the restarted shard serves version 5 = E
    assert (a.version, restarted.version) == (join_round - 1, join_round)
    a.book.commit(rank, "t2", join_round, a.version)  # the joiner's commits, side by side: shard 0 takes it ...
    a.live.add(rank)
    a.tick()
    assert a.version == join_round - 1, "shard 0 served the join round before every shard took the commit"
    with pytest.raises(JobMismatch, match=f"join_round is {join_round} but shard 1 is at version {join_round}"):
        restarted.book.commit(rank, "t2", join_round, restarted.version)  # ... the restarted one cannot
    a.book.leave(rank, at=a.version)  # so no confirm: the joiner leaves everywhere, withdrawing shard 0's epoch
    a.live.discard(rank)
    a.tick()
    assert a.version == join_round and same_members_served([a, restarted], join_round)
    rank, again = prepare_everywhere([a, restarted], "t2")  # and asks again: one boundary on both
    step([a, restarted])
    step([a, restarted])
    commit_everywhere([a, restarted], rank, "t2", again)
    step([a, restarted], ranks=(0, 1, rank))
    assert a.version == restarted.version == again + 1
    assert rank in a.served_with[again] and rank in restarted.served_with[again]
    assert rank not in a.served_with[again - 1] and same_members_served([a, restarted], again + 1)


def test_a_commit_is_held_until_every_shard_confirms_so_a_refusal_elsewhere_is_withdrawn_before_the_round_is_served():
    a, b = SimShard("shard 0"), SimShard("shard 1")
    rank, join_round = prepare_everywhere([a, b], "t2")
    step([a, b])
    step([a, b])  # round join_round - 1 is complete on both, held
    a.book.commit(rank, "t2", join_round, a.version)
    b.book.commit(rank, "t2", join_round, b.version)
    a.tick(), b.tick()
    assert a.version == b.version == join_round - 1 and a.open_round_held() and b.open_round_held()
    a.book.confirm(rank, "t2", join_round, a.version)
    a.tick()
    assert a.version == join_round and b.version == join_round - 1  # shard 1 waits for its own confirm
