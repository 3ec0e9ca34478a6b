"""The async data cursor's decisions (psserver.members.data_cursor): pure, no network, no clock needed."""

from collections import Counter
from types import SimpleNamespace

import pytest

from psserver.members.data_cursor import MAX_BATCHES_PER_EPOCH, DataCursor
from psserver.protocol.errors import InvalidRequest, JobMismatch
from trainer.workloads.data import batch_place

P = 4  # batches per data epoch


def cursor():
    return DataCursor(Counter())


def test_claims_of_two_ranks_get_consecutive_batches_each_once():
    c = cursor()
    got = [c.claim(0, "a", 1, P).batch, c.claim(1, "b", 1, P).batch, c.claim(0, "a", 2, P).batch,
           c.claim(1, "b", 2, P).batch]
    assert got == [0, 1, 2, 3]


def test_a_retried_claim_gets_the_same_batch_and_grants_nothing_new():
    c = cursor()
    first = c.claim(0, "a", 1, P)
    before = c.state()
    assert c.claim(0, "a", 1, P) == first
    assert c.state() == before and c._counters["claim_retries"] == 1
    assert c.claim(1, "b", 1, P).batch == 1


def test_a_claim_number_skipping_ahead_or_going_back_is_refused_naming_both_and_changes_nothing():
    c = cursor()
    c.claim(0, "a", 1, P)
    c.claim(0, "a", 2, P)
    before = c.state()
    for bad in (4, 1):
        with pytest.raises(InvalidRequest, match=rf"claim is {bad} but rank 0's next claim is 3 \(or 2"):
            c.claim(0, "a", bad, P)
    assert c.state() == before


def test_batches_per_epoch_out_of_bounds_or_unlike_the_jobs_is_refused_naming_both():
    c = cursor()
    for bad in (0, MAX_BATCHES_PER_EPOCH + 1):
        with pytest.raises(InvalidRequest, match=f"batches_per_epoch is {bad} but must be 1.."):
            c.claim(0, "a", 1, bad)
    c.claim(0, "a", 1, P)
    before = c.state()
    with pytest.raises(JobMismatch, match=f"batches_per_epoch is {P + 1} but the job's is {P}"):
        c.claim(1, "b", 1, P + 1)
    assert c.state() == before


def test_a_rank_leaving_with_a_claimed_batch_has_it_reissued_first_to_the_next_claim():
    c = cursor()
    c.claim(0, "a", 1, P)  # 0
    c.claim(1, "b", 1, P)  # 1
    assert c.leave(1) == 1
    c.claim(0, "a", 2, P)  # batch 0 trained; gets the leaver's batch
    assert c.claims[0].batch == 1 and c.claims[0].reissued
    assert c.claim(0, "a", 3, P).batch == 2
    assert c._counters["batches_reissued"] == 1


def test_a_released_claim_is_not_reissued_at_the_leave():
    c = cursor()
    c.claim(0, "a", 1, P)
    assert c.claim(0, "a", 2, P, release=True).batch is None
    assert c.claim(0, "a", 2, P, release=True).batch is None  # a retried release
    assert c.leave(0) is None and c.reissue == []
    assert c.claim(1, "b", 1, P).batch == 1


def test_a_new_process_on_a_rank_reissues_the_old_ones_batch_and_starts_at_claim_1():
    c = cursor()
    c.claim(0, "old", 1, P)  # 0
    with pytest.raises(InvalidRequest, match="claim is 2 but rank 0's next claim is 1"):
        c.claim(0, "new", 2, P)
    assert c.claim(0, "new", 1, P).batch == 0  # the old process's batch, re-issued to it
    assert c._counters["batches_reissued"] == 1


def test_every_batch_of_two_data_epochs_is_granted_once_across_a_join_a_leave_and_uneven_speeds():
    c = cursor()
    trained = []
    numbers = Counter()

    def step(rank):
        numbers[rank] += 1
        held = c.claims.get(rank)
        if held is not None and held.batch is not None:
            trained.append(held.batch)
        return c.claim(rank, f"t{rank}", numbers[rank], P).batch

    for _ in range(2):
        step(0)
    step(1)  # rank 1 is slower
    step(0)
    step(2)  # a joiner
    c.leave(1)  # rank 1 leaves with its batch untrained
    while len(trained) + 2 < 2 * P:
        step(0)
        step(2)
    trained += [c.claims[0].batch, c.claims[2].batch]
    assert sorted(trained)[: 2 * P] == list(range(2 * P))
    assert len(trained) == len(set(trained))


def test_state_survives_a_checkpoint_round_trip_and_changes_the_digest():
    c = cursor()
    empty = c.digest_text()
    c.claim(0, "a", 1, P)
    c.claim(1, "b", 1, P)
    c.leave(1)
    again = cursor()
    again.restore(c.state())
    assert again.state() == c.state() and again.digest_text() == c.digest_text() != empty
    assert again.claim(2, "c", 1, P).batch == 1


def test_after_a_restore_each_ranks_first_claim_resumes_once_and_out_of_turn_is_refused_again_after():
    c = cursor()
    c.claim(0, "a", 1, P)
    checkpoint = c.state()
    for n in (2, 3, 4):  # granted after the checkpoint: the restore forgets them
        c.claim(0, "a", n, P)
    counters = Counter()
    restored = DataCursor(counters)
    restored.restore(checkpoint)
    with pytest.raises(InvalidRequest, match="claim is 9"):
        cursor().claim(0, "a", 9, P)  # a cursor never restored refuses a claim out of turn
    grant = restored.claim(0, "a", 5, P)  # the trainer is at claim 5: taken as it comes
    assert grant.batch == 1 and counters["claims_resumed_after_restore"] == 1
    assert restored.claim(0, "a", 5, P).batch == 1  # its retry is a retry
    assert restored.claim(0, "a", 6, P).batch == 2
    with pytest.raises(InvalidRequest, match="claim is 9"):
        restored.claim(0, "a", 9, P)  # only the first claim since the restore resumes
    assert restored.claim(1, "b", 3, P).batch == 3  # a rank the checkpoint did not hold resumes too


def test_batch_place_rolls_over_into_the_next_data_epoch():
    assert [batch_place(k, P, 8) for k in (0, 3, 4, 9)] == [(0, 0), (0, 24), (1, 0), (2, 8)]


class FakeCursorShard:
    """Shard 0 partition 0's ClaimBatch as the trainer's client sees it, answered by a real DataCursor."""

    def __init__(self, cursor_):
        self.cursor, self.sent = cursor_, []
        self.dense = SimpleNamespace(claim_ask=None, claim_answer=None)  # (trainer.channels.dense_calls.DenseCalls)

    def push_pull(self):
        """What DenseCalls.push_pull does with an armed claim: the shard grants it with the push's reply."""
        dense = self.dense
        if dense.claim_ask is not None:
            grant = self.cursor.claim(0, "t0", *dense.claim_ask)
            dense.claim_answer = (dense.claim_ask[0], grant.batch, grant.reissued)

    def claim_batch(self, claim, batches_per_epoch, release, timeout):
        self.sent.append((claim, release))
        grant = self.cursor.claim(0, "t0", claim, batches_per_epoch, release)
        return SimpleNamespace(batch=grant.batch or 0, granted=grant.batch is not None, reissued=grant.reissued)


def test_a_trainers_claims_are_numbered_in_turn_and_its_release_follows_its_last_claim():
    from trainer.membership.data_claims import BatchClaims

    c = cursor()
    c.claim(1, "t1", 1, P)
    c.leave(1)  # batch 0 waits to be re-issued
    shard = FakeCursorShard(c)
    claims = BatchClaims(shard, P)
    assert [claims.next(), claims.next(), claims.next()] == [0, 1, 2]
    claims.release()
    assert shard.sent == [(1, False), (2, False), (3, False), (4, True)]
    assert claims.claimed == [0, 1, 2] and claims.reissued == 1 and c.leave(0) is None


def test_a_trainer_that_claimed_nothing_sends_no_release():
    from trainer.membership.data_claims import BatchClaims

    shard = FakeCursorShard(cursor())
    BatchClaims(shard, P).release()
    assert shard.sent == []


def test_a_claim_armed_on_a_push_is_taken_from_its_reply_without_a_call_and_falls_back_to_one_otherwise():
    from trainer.membership.data_claims import BatchClaims

    shard = FakeCursorShard(cursor())
    claims = BatchClaims(shard, P)
    assert claims.next() == 0  # the first claim: a call
    claims.arm()
    shard.push_pull()  # the step's push carries claim 2
    assert claims.next() == 1 and claims.with_push == 1
    claims.arm()  # this step's push does not bring the grant back (say, dropped as stale)
    assert claims.next() == 2
    assert shard.sent == [(1, False), (3, False)] and claims.number == 3 and shard.dense.claim_ask is None


def test_a_checkpoint_taken_by_a_push_holds_that_pushs_claim_grant_and_acknowledgement():
    """The checkpoint a push's step makes is restored as the state after that push: its gradient, so its claim
    (granted once the gradient is taken) and its acknowledgement too -- else a restore from it re-grants that batch
    (trained twice) and applies that push's retry again."""
    import torch

    from psserver.partition.shard import Shard
    from tests.conftest import P, make_spec

    shard = Shard(0, clock=lambda: 100.0, lease_timeout=600.0)
    shard.register(0, "t0", 0, make_spec(mode="async", num_trainers=1, max_trainers=2))
    shard.init(0, "t0", "f" * 16, torch.zeros(P))
    captured = []
    shard.checkpoints.after_step = lambda version, capture: captured.append(capture())
    assert shard.dense_pushes.claim_batch(0, "t0", "f" * 16, 1, 8).batch == 0
    shard.push(0, "t0", "f" * 16, 0, 1, torch.ones(P), sequence=1, claim=(2, 8))
    state = captured[-1]
    assert state.version == 1
    assert state.cursor["claims"][0][1:3] == (2, 1) and state.cursor["next"] == 2, state.cursor
    assert state.acked[0][:2] == ("t0", 1), state.acked


def test_a_rank_may_claim_at_most_a_push_windows_worth_of_batches_ahead_of_its_pushes():
    """Issue 35 item 8: a member claimed 2,000 batches in 1.3 s and trained none.  Each gradient it sends backs one
    claim; 64 claims (MAX_UNBACKED_CLAIMS, a push window) may run ahead, the next is refused, changing nothing,
    and a push lets it claim again.  A new process on the rank, a leave and a release start afresh."""
    from psserver.members.data_cursor import MAX_UNBACKED_CLAIMS

    c = cursor()
    c.claim(0, "a", 1, 10**6)  # the first claim says nothing was trained: not counted
    for n in range(2, MAX_UNBACKED_CLAIMS + 2):
        c.claim(0, "a", n, 10**6)
    before = c.state()
    with pytest.raises(JobMismatch, match=f"claim is {MAX_UNBACKED_CLAIMS + 2} but rank 0 has claimed "
                                          f"{MAX_UNBACKED_CLAIMS} batches more than it pushed gradients for"):
        c.claim(0, "a", MAX_UNBACKED_CLAIMS + 2, 10**6)
    assert c.state() == before and c._counters["claims_refused_unbacked"] == 1
    assert c.claim(0, "a", MAX_UNBACKED_CLAIMS + 1, 10**6).batch == before["claims"][0][2]  # a retry still answered
    c.pushed(0)
    assert c.claim(0, "a", MAX_UNBACKED_CLAIMS + 2, 10**6).batch == MAX_UNBACKED_CLAIMS + 1
    for _ in range(MAX_UNBACKED_CLAIMS + 5):  # pushes past the claims back nothing in advance
        c.pushed(0)
    assert c.ahead[0] == 0
    c.claim(0, "a", MAX_UNBACKED_CLAIMS + 3, 10**6)
    assert c.ahead[0] == 1
    c.claim(0, "b", 1, 10**6)  # a new process on the rank starts afresh (its first claim)
    assert 0 not in c.ahead
    c.claim(0, "b", 2, 10**6)
    c.leave(0)
    assert 0 not in c.ahead
