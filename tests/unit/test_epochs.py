"""Membership epochs as pure decisions (psserver.members.epochs): joins, leaves and lease expiry at round boundaries,
with a fake clock and no network."""

import grpc
import pytest

from psserver.members.epochs import DEFAULT_JOIN_TIMEOUT, MAX_PENDING_JOINS, EpochBook, join_patience
from psserver.partition.shard import Shard
from psserver.protocol.epochs import JOIN_LEAD, Epoch, commit_window, epoch_at
from psserver.protocol.errors import FutureVersion, InvalidRequest, JobFull, JobMismatch, TooBusy
from psserver.state import modes
from tests.conftest import make_spec

PATIENCE = 5.0


def elastic(n=2, k=4) -> EpochBook:
    return EpochBook(n, k, "shard 0")


def test_a_join_is_admitted_from_the_largest_proposal_and_earlier_rounds_keep_the_old_epoch():
    shard_a, shard_b = elastic(), elastic()
    pa = shard_a.prepare(None, "t2", version=5, now=0.0, patience=PATIENCE)
    pb = shard_b.prepare(2, "t2", version=6, now=0.0, patience=PATIENCE)  # one round ahead
    assert (pa.proposal, pb.proposal) == (5 + JOIN_LEAD, 6 + JOIN_LEAD)
    join_round = max(pa.proposal, pb.proposal)
    for book, version in ((shard_a, 6), (shard_b, 7)):
        epoch = book.commit(2, "t2", join_round, version)
        assert epoch == Epoch(1, join_round, frozenset({0, 1, 2}))
        assert book.members_at(join_round - 1) == {0, 1}
        assert book.members_at(join_round) == {0, 1, 2}
        assert book.held_from() == join_round - 1  # committed: the round before is held until the confirm
        book.confirm(2, "t2", join_round, version)
        assert book.pending == {}


def test_a_pending_join_holds_rounds_after_the_open_one_until_it_is_settled():
    book = elastic()
    book.prepare(None, "t2", version=5, now=0.0, patience=PATIENCE)
    assert book.held_from() == 6  # round 5 (open now) closes as usual
    cfg = modes.ModeConfig("sync")
    open_round = modes.RoundView(version=5, live=frozenset({0, 1}), contributors=frozenset({0}), held=False)
    assert modes.decide_push(cfg, open_round, 1, 5, 0.0).close is modes.CloseReason.ALL_ARRIVED
    held = modes.RoundView(version=6, live=frozenset({0, 1}), contributors=frozenset({0}), held=True)
    d = modes.decide_push(cfg, held, 1, 6, 0.0)
    assert d.action is modes.Action.ACCUMULATE and d.close is None
    book.commit(2, "t2", 7, version=6)
    assert book.held_from() == 6  # committed: round 6 closes only once every shard took the commit
    book.confirm(2, "t2", 7, version=6)
    assert book.held_from() is None


def test_a_join_never_committed_is_dropped_at_its_deadline_on_the_fake_clock():
    book = elastic()
    book.prepare(None, "t2", version=3, now=10.0, patience=PATIENCE)
    assert book.next_deadline() == 15.0
    assert book.expire(14.9) == []
    assert [r for r, _ in book.expire(15.0)] == [2]
    assert book.held_from() is None and book.current.number == 0


def test_two_joins_in_one_round_make_one_epoch_with_both_and_distinct_ranks():
    book = elastic()
    a = book.prepare(None, "ta", version=4, now=0.0, patience=PATIENCE)
    b = book.prepare(None, "tb", version=4, now=0.0, patience=PATIENCE)
    ranks = sorted(book.pending)
    assert ranks == [2, 3] and a.proposal == b.proposal == 6
    book.commit(2, "ta", 6, version=5)
    book.commit(3, "tb", 6, version=5)
    assert [e.round for e in book.timeline] == [0, 6]
    assert book.members_at(6) == {0, 1, 2, 3}
    assert book.current.number == 2


def test_join_leave_and_lease_expiry_at_the_same_boundary():
    book = elastic(3, 4)
    book.prepare(None, "t3", version=8, now=0.0, patience=PATIENCE)
    book.commit(3, "t3", 10, version=9)
    book.leave(1, at=10)  # rank 1 said goodbye after its step 9
    assert book.members_at(9) == {0, 1, 2}
    assert book.members_at(10) == {0, 2, 3}
    # rank 2's lease ran out: still a member (it may come back) but round 10 does not wait for it
    live = frozenset({0, 3})
    assert book.expected(live, 10) == {0, 3}
    assert book.expected(frozenset({0, 1, 2, 3}), 9) == {0, 1, 2}  # the joiner is not expected before 10


def test_a_join_during_a_shard_restart_commits_without_a_prepare_while_the_round_is_not_served():
    before = elastic()
    before.prepare(None, "t2", version=5, now=0.0, patience=PATIENCE)
    restarted = elastic()
    restarted.restore(before.state())  # the checkpoint has the timeline, not the pending join
    assert restarted.pending == {}
    assert restarted.commit(2, "t2", 7, version=6).members == {0, 1, 2}
    late = elastic()
    late.restore(before.state())
    with pytest.raises(JobMismatch, match="join_round is 7 but shard 0 is at version 7"):
        late.commit(2, "t2", 7, version=7)
    assert late.current.number == 0


def test_refusals_change_nothing():
    closed = EpochBook(2, 0)
    with pytest.raises(JobMismatch, match="max_trainers is 0 \\(num_trainers 2\\)"):
        closed.prepare(None, "t", 0, 0.0, PATIENCE)
    full = elastic(2, 3)
    full.prepare(None, "t2", 0, 0.0, PATIENCE)
    with pytest.raises(JobFull, match="max_trainers 3"):
        full.prepare(None, "t3", 0, 0.0, PATIENCE)
    with pytest.raises(JobFull, match="rank 0 is already a member"):
        full.prepare(0, "t9", 0, 0.0, PATIENCE)
    with pytest.raises(FutureVersion, match="join_round is 9 but shard 0 is at version 1: at most 4"):
        full.commit(2, "t2", 9, version=1)
    with pytest.raises(InvalidRequest, match="join_round is 1 but shard 0 proposed 2"):
        full.commit(2, "t2", 1, version=0)
    assert full.current.number == 0 and list(full.pending) == [2]


def test_a_retried_admission_gets_the_same_rank_and_proposal():
    book = elastic()
    first = book.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    again = book.prepare(None, "t2", version=4, now=1.0, patience=PATIENCE)
    assert again == first and list(book.pending) == [2]


def test_a_left_rank_is_free_again_and_the_lowest_free_rank_is_given():
    book = elastic(3, 3)
    book.leave(1, at=4)
    book.prepare(None, "new", version=4, now=0.0, patience=PATIENCE)
    assert list(book.pending) == [1]


def test_commit_window_and_epoch_at():
    assert commit_window(5, 5) == "late" and commit_window(5, 6) == "" and commit_window(5, 9) == "ahead"
    timeline = [Epoch(0, 0, frozenset({0})), Epoch(1, 4, frozenset({0, 1}))]
    assert epoch_at(timeline, 3).number == 0 and epoch_at(timeline, 4).number == 1


@pytest.mark.parametrize("members,expected", [(2, 1), (3, 2), (4, 3), (1, 1)])
def test_stale_timeout_quorum_keeps_the_number_of_backup_workers(members, expected):
    cfg = modes.ModeConfig("stale-timeout", sync_timeout=1.0, replicas_to_aggregate=2, num_trainers=3)
    assert modes.quorum(cfg, members) == expected


def test_a_join_committed_at_an_earlier_round_after_a_later_one_is_inserted_before_it():
    book = elastic(2, 4)
    book.prepare(None, "b", version=4, now=0.0, patience=PATIENCE)  # proposes 6
    book.prepare(None, "a", version=5, now=0.0, patience=PATIENCE)  # proposes 7 (asked a round later)
    book.commit(3, "a", 7, version=5)
    book.commit(2, "b", 6, version=5)
    assert [(e.round, sorted(e.members)) for e in book.timeline] == [(0, [0, 1]), (6, [0, 1, 2]), (7, [0, 1, 2, 3])]
    assert len({e.number for e in book.timeline}) == 3


def test_a_joiner_that_gives_up_after_committing_is_withdrawn_from_the_epoch_it_was_admitted_to():
    book = elastic()
    book.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    book.commit(2, "t2", 5, version=4)
    book.leave(2, at=4)
    assert book.members_at(5) == {0, 1} and book.current.number > 1


@pytest.mark.parametrize("join_timeout, lease, expected", [
    (0.0, 0.0, DEFAULT_JOIN_TIMEOUT),  # leases off: the default, never 0
    (0.0, 5.0, DEFAULT_JOIN_TIMEOUT),  # shorter than the default lease: the hold needs one round trip
    (0.0, 1.0, 1.0),  # a lease shorter than the default
    (10.0, 0.0, 10.0),  # --join-timeout given
])
def test_join_patience_is_never_zero_and_defaults_below_the_lease(join_timeout, lease, expected):
    assert join_patience(join_timeout, lease) == expected


def test_with_leases_off_a_pending_join_is_held_until_its_join_timeout_on_the_fake_clock():
    clock = [100.0]
    shard = Shard(0, clock=lambda: clock[0], lease_timeout=0.0, join_timeout=4.0)
    spec = make_spec(num_trainers=1, max_trainers=3)
    shard.register(0, "t0", 0, spec)
    assert shard.register(1, "j", 0, spec, join=True)["rank"] == 1
    shard.tick()
    clock[0] += 3.9
    shard.tick()
    assert shard.epochs.pending and shard.counters["joins_abandoned"] == 0
    clock[0] += 0.1
    shard.tick()
    assert not shard.epochs.pending and shard.counters["joins_abandoned"] == 1


def test_joins_pending_at_once_are_capped_resource_exhausted_counted_and_change_nothing():
    shard = Shard(0, clock=lambda: 0.0, lease_timeout=5.0)
    spec = make_spec(num_trainers=1, max_trainers=MAX_PENDING_JOINS + 3)
    shard.register(0, "t0", 0, spec)
    for k in range(MAX_PENDING_JOINS):
        shard.register(0, f"stranger{k}", 0, spec, join=True)
    before = shard.state_digest()
    with pytest.raises(TooBusy, match=f"has {MAX_PENDING_JOINS} joins pending .* its limit {MAX_PENDING_JOINS}"):
        shard.register(0, "late", 0, spec, join=True)
    assert shard.state_digest() == before and shard.counters["joins_refused_pending"] == 1
    assert TooBusy.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert shard.register(0, "stranger0", 0, spec, join=True)["rank"] == 1  # a retry is still answered



def test_changes_past_max_member_entries_are_refused_timeline_full_and_change_nothing(monkeypatch):
    """The timeline's memory is bounded by the members it lists, not only by its epochs: MAX_EPOCHS epochs of
    MAX_TRAINERS members each held ~770 MB (docs/security.md)."""
    monkeypatch.setattr("psserver.members.epochs.MAX_MEMBER_ENTRIES", 7)
    book = elastic(n=2, k=4)  # epoch 0 lists 2 members
    book.leave(1, at=1)  # + 1 = 3
    book.registered(1, at=2)  # + 2 = 5
    book.leave(1, at=3)  # + 1 = 6
    before = book.digest_text()
    with pytest.raises(JobFull, match=r"rank 1 registering \(not a member since it left\) from round 4 would make "
                                      "the job's membership timeline list 8 members over its 5 epochs but it holds "
                                      "at most MAX_MEMBER_ENTRIES 7"):
        book.registered(1, at=4)
    assert book.digest_text() == before
    book.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    before = book.digest_text()
    with pytest.raises(JobFull, match="join_round 5 would make the job's membership timeline list 8 members"):
        book.commit(1, "t2", 5, version=4)
    assert book.digest_text() == before, "a refused commit withdrew the pending join or changed the timeline"


def test_a_retried_commit_is_answered_the_same_and_changes_nothing():
    book = elastic()
    book.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    first = book.commit(2, "t2", 5, version=4, now=0.0, patience=PATIENCE)
    before = book.digest_text()
    assert book.commit(2, "t2", 5, version=4, now=1.0, patience=PATIENCE) == first  # its reply was lost
    assert book.digest_text() == before
    with pytest.raises(InvalidRequest, match="join_round is 6 but shard 0 took this join's commit at round 5"):
        book.commit(2, "t2", 6, version=4)
    assert book.digest_text() == before


def test_a_commit_in_a_restored_checkpoint_is_answered_again_and_its_confirm_is_taken():
    book = elastic()
    book.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    book.commit(2, "t2", 5, version=4)
    restarted = elastic()
    restarted.restore(book.state())  # checkpointed after the commit, restarted before the confirm
    assert restarted.commit(2, "t2", 5, version=4).members == {0, 1, 2} and restarted.current.number == 1
    assert restarted.confirm(2, "t2", 5, version=4).members == {0, 1, 2}
    assert restarted.timeline == book.timeline and restarted.pending == {}


def test_a_confirm_on_a_shard_that_lost_the_commit_is_its_commit_while_the_round_is_not_served():
    book = elastic()
    restarted = elastic()  # restarted after the commit from a checkpoint without it
    assert restarted.confirm(2, "t2", 5, version=4).members == {0, 1, 2}
    assert restarted.held_from() is None
    late = elastic()
    with pytest.raises(JobMismatch, match="join_round is 5 but shard 0 is at version 5"):
        late.confirm(2, "t2", 5, version=5)
    assert late.digest_text() == book.digest_text()


def test_a_committed_join_never_confirmed_is_withdrawn_at_its_deadline_as_a_shard_that_never_got_the_commit_drops_it():
    """Issue 35 item 3: a join committed on one shard only (its joiner lost between commits, or a stranger that
    stops there) used to keep its epoch there while the other shard dropped the admission: two timelines for good.
    Now both end where they began, epoch numbers included, and neither holds a round."""
    book, other = elastic(), elastic()
    for b in (book, other):
        b.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    before = book.state()
    book.commit(2, "t2", 5, version=4, now=1.0, patience=PATIENCE)
    assert book.members_at(5) == {0, 1, 2}
    assert book.expire(5.9, version=4) == [] and book.held_from() == 4
    gone = book.expire(6.0, version=4)
    assert [(r, p.committed) for r, p in gone] == [(2, 5)]
    assert book.held_from() is None and book.members_at(5) == {0, 1}
    assert [r for r, _ in other.expire(6.0, version=4)] == [2]
    assert book.state() == other.state() == before
    assert book.digest_text() == other.digest_text()


def test_a_withdrawn_join_whose_round_was_served_leaves_from_the_next_round_only():
    """An async shard's versions do not wait for a join: one past the join round keeps the rounds it served with
    the joiner and drops it from the next; a timeline changed since the commit is changed, not put back."""
    book = elastic()
    book.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    book.commit(2, "t2", 5, version=4, now=1.0, patience=PATIENCE)
    book.expire(6.0, version=7)
    assert book.members_at(5) == book.members_at(7) == {0, 1, 2} and book.members_at(8) == {0, 1}
    changed = elastic()
    changed.prepare(None, "t2", version=3, now=0.0, patience=PATIENCE)
    changed.commit(2, "t2", 5, version=4, now=1.0, patience=PATIENCE)
    changed.leave(1, 6)
    changed.expire(6.0, version=4)
    assert changed.members_at(5) == {0, 1} and changed.members_at(6) == {0}


def test_an_async_commit_on_a_shard_restored_behind_its_peers_is_taken_in_its_own_window_never_refused():
    """Async (and stale-timeout) shards keep their own versions: one restored from a checkpoint stays behind its
    peers for good, so the largest proposal may be past its window.  Sync refuses that (an epoch from the
    future); async takes it clamped into the window -- no data is split by the round there -- and answers retries
    and the confirm alike."""
    behind = elastic()
    behind.prepare(2, "t2", version=10, now=0.0, patience=PATIENCE)  # proposes 12; its peer, at 12, proposed 14
    with pytest.raises(FutureVersion, match="join_round is 14 but shard 0 is at version 10: at most 13"):
        behind.commit(2, "t2", 14, version=10)
    assert behind.current.number == 0
    epoch = behind.commit(2, "t2", 14, version=10, exact=False)
    assert epoch.round == 13 and behind.members_at(13) == {0, 1, 2} and behind.held_from() == 12
    assert behind.commit(2, "t2", 14, version=10, exact=False) == epoch  # a retry
    assert behind.confirm(2, "t2", 14, version=10, exact=False) == epoch and behind.pending == {}
    assert behind.confirm(2, "t2", 14, version=11, exact=False) == epoch  # a confirm again
    late = elastic()
    late.prepare(2, "t2", version=3, now=0.0, patience=PATIENCE)
    assert late.commit(2, "t2", 5, version=6, exact=False).round == 7  # pushes moved it on meanwhile


def test_a_peer_whose_joins_expire_unsettled_waits_longer_each_time_and_a_settled_join_clears_it():
    """Issue 35 item 7: one Register every 0.3 s from one host held a sync job's rounds again and again (94x
    slower).  Each join of a peer that expires unsettled (uncommitted, or committed and never confirmed) doubles
    the wait before its next admission; other peers are not affected; a join of it that settles clears it."""
    from psserver.members.epochs import MAX_JOIN_BACKOFF, JoinBackoff

    book = elastic()
    book.prepare(None, "s1", version=3, now=0.0, patience=PATIENCE, peer="10.0.0.9")
    book.expire(PATIENCE, version=3)
    before = book.digest_text()
    with pytest.raises(JoinBackoff, match=r"peer '?10.0.0.9'? left 1 join\(s\) in a row unsettled.*in 10.0 s"):
        book.prepare(None, "s2", version=3, now=PATIENCE, patience=PATIENCE, peer="10.0.0.9")
    assert book.digest_text() == before  # refused: nothing held
    book.prepare(None, "real", version=3, now=PATIENCE, patience=PATIENCE, peer="10.0.0.5")  # another host
    book.abandon(2, "real")
    t = PATIENCE + 2 * PATIENCE  # its wait is over
    book.prepare(None, "s2", version=3, now=t, patience=PATIENCE, peer="10.0.0.9")
    book.commit(2, "s2", 5, version=4, now=t, patience=PATIENCE)  # committed, never confirmed: a strike too
    book.expire(t + PATIENCE, version=4)
    with pytest.raises(JoinBackoff, match=r"left 2 join\(s\).*in 20.0 s"):
        book.prepare(None, "s3", version=4, now=t + PATIENCE, patience=PATIENCE, peer="10.0.0.9")
    t += PATIENCE + 4 * PATIENCE
    book.prepare(None, "s3", version=4, now=t, patience=PATIENCE, peer="10.0.0.9")
    book.commit(2, "s3", 6, version=4, now=t, patience=PATIENCE)
    book.confirm(2, "s3", 6, version=4, now=t)  # settled: the peer's strikes are cleared
    book.leave(2, 7)
    book.prepare(None, "s4", version=6, now=t, patience=PATIENCE, peer="10.0.0.9")
    for k in range(20):  # the wait stops growing at MAX_JOIN_BACKOFF
        book.expire(t + 10**6 * (k + 1), version=6)
        book.strikes.strike("10.0.0.9", 0.0, PATIENCE)
    with pytest.raises(JoinBackoff, match=f"in {MAX_JOIN_BACKOFF:.1f} s"):
        book.prepare(None, "s5", version=6, now=0.0, patience=PATIENCE, peer="10.0.0.9")
