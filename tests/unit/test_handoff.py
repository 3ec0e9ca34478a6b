"""The live re-shard's hand-off as pure machines (psserver.resharding.handoff.machine*): one test per row of docs/design/live-reshard.md's
state table and failure table, with a fake clock and no network."""

import copy
from dataclasses import replace

import grpc
import pytest

from psserver.protocol.epochs import JOIN_LEAD
from psserver.protocol.errors import PsError
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff.dest import DestPiece, DestState
from psserver.resharding.handoff.source import APPLY, DUPLICATE, LAYOUT_MOVED, STALE, SourceMove, SourceState
from psserver.resharding.handoff.termination import AGREE, Known

TIMEOUT = 5.0
A, B = 1_000, 1_777  # the move's range: plain ints, no layout type


def run(machine, *events, now=0.0):
    """Feed ``events`` in order at ``now``; returns the last machine and every action, in order."""
    actions = []
    for event in events:
        machine, out = machine.on(event, now)
        actions += out
    return machine, actions


def source(**kw) -> SourceMove:
    return SourceMove(A, B, timeout=TIMEOUT, label="shard 0", **kw)


def tailing(v0=10, closed=0) -> SourceMove:
    """A source whose copy at ``v0`` was acknowledged, ``closed`` rounds after it forwarded and acknowledged."""
    s, _ = run(source(), h.Prepare(v0), h.CopyAcked(v0))
    for v in range(v0, v0 + closed):
        s, _ = run(s, h.RoundClosed(v), h.ForwardAcked(v))
    return s


def blocked(v=10, now=0.0) -> SourceMove:
    """TAILING at v -> proposed -> committed at v + JOIN_LEAD -> rounds up to R-1 closed and acknowledged."""
    s, _ = run(tailing(v), h.Propose(v), h.Commit(v + JOIN_LEAD), now=now)
    for r in range(v, v + JOIN_LEAD):
        s, _ = run(s, h.RoundClosed(r), h.ForwardAcked(r), now=now)
    assert s.state is SourceState.BLOCKED
    return s


def refused(machine, event, code, *words, now=0.0):
    """The refusal's one status, a message naming the values, and the machine unchanged (still takes events)."""
    before = copy.deepcopy(machine)
    with pytest.raises(PsError) as e:
        machine.on(event, now)
    assert machine == before
    assert e.value.code is code, e.value
    for word in words:
        assert str(word) in str(e.value), (word, str(e.value))
    return e.value


def counted(actions) -> list[str]:
    return [a.metric for a in actions if isinstance(a, h.Count)]


# ============================================================================================ source: the states
def test_owner_prepare_snapshots_the_range_at_v0_and_a_repeated_prepare_answers_the_same():
    s, actions = run(source(), h.Prepare(10))
    assert s.state is SourceState.COPYING and actions == [h.TakeSnapshot(A, B, 10)]
    assert run(s, h.Prepare(12)) == (s, [])


def test_rounds_closed_while_copying_are_forwarded_in_order_once_the_copy_is_acknowledged():
    s, actions = run(source(), h.Prepare(10), h.RoundClosed(10), h.RoundClosed(11, stepped=False))
    assert not [a for a in actions if isinstance(a, h.SendForward)]
    s, actions = run(s, h.CopyAcked(10))
    assert s.state is SourceState.TAILING and actions == [h.SendForward(10), h.SendForward(11)]


def test_a_late_ack_of_a_copy_taken_again_since_changes_nothing():
    s, _ = run(source(max_lag=1), h.Prepare(10), h.RoundClosed(10), h.RoundClosed(11))  # copied again at 12
    assert s.copied_at == 12
    assert run(s, h.CopyAcked(10)) == (s, [])


def test_tailing_forwards_every_closed_round_including_one_closed_without_a_step():
    s, actions = run(tailing(), h.RoundClosed(10), h.RoundClosed(11, stepped=False))
    assert actions == [h.SendForward(10), h.SendForward(11)] and s.version == 12


def test_propose_holds_rounds_after_the_open_one_and_proposes_version_plus_join_lead():
    s, actions = run(tailing(), h.Propose(10), now=100.0)
    assert s.state is SourceState.HOLDING and s.proposal == 10 + JOIN_LEAD
    assert actions == [h.HoldRounds(11)] and s.deadline == 100.0 + TIMEOUT
    assert run(s, h.Propose(10), now=101.0) == (s, [])


def test_propose_before_the_copy_is_acknowledged_is_refused_naming_the_state():
    s, _ = run(source(), h.Prepare(10))
    refused(s, h.Propose(10), grpc.StatusCode.FAILED_PRECONDITION, "copying", "not tailing")


def test_the_hold_expires_back_to_tailing_at_the_handoff_timeout_and_is_counted():
    s, _ = run(tailing(), h.Propose(10), now=100.0)
    assert run(s, h.Tick(), now=100.0 + TIMEOUT - 0.01) == (s, [])
    s, actions = run(s, h.Tick(), now=100.0 + TIMEOUT)
    assert s.state is SourceState.TAILING and s.proposal is None
    assert actions[0] == h.ReleaseRounds() and counted(actions) == ["handoff_holds_expired"]


def test_commit_moves_the_hold_to_R_and_holds_the_replies_that_hand_out_R_so_rounds_below_R_still_close():
    s, actions = run(tailing(), h.Propose(10), h.Commit(12))
    assert s.state is SourceState.BLOCKING and s.round == 12 and actions[-2:] == [h.HoldReplies(12), h.HoldRounds(12)]
    assert run(s, h.Commit(12)) == (s, [])  # asked twice


def test_a_round_open_at_commit_closes_in_the_old_layout_and_is_forwarded():
    s, _ = run(tailing(), h.Propose(10), h.Commit(12))
    s, actions = run(s, h.RoundClosed(10))  # round 10 was open when COMMIT came
    assert actions == [h.SendForward(10)] and s.state is SourceState.BLOCKING
    s, actions = run(s, h.RoundClosed(11))  # its replies are held since the commit
    assert actions == [h.SendForward(11)]


def test_a_round_at_or_past_R_never_closes_on_the_source():
    s, _ = run(tailing(), h.Propose(10), h.Commit(12), h.RoundClosed(10), h.RoundClosed(11))
    refused(s, h.RoundClosed(12), grpc.StatusCode.INVALID_ARGUMENT, "R=12")


def test_the_ack_of_forward_R_minus_1_blocks_the_source_and_it_votes():
    s, _ = run(tailing(), h.Propose(10), h.Commit(12), h.RoundClosed(10), h.RoundClosed(11), h.ForwardAcked(10))
    assert s.state is SourceState.BLOCKING
    s, actions = run(s, h.ForwardAcked(11), now=50.0)
    assert s.state is SourceState.BLOCKED and actions == [h.SendVote(12, False)] and s.deadline == 50.0 + TIMEOUT


def test_decide_switch_hands_the_range_over_releasing_replies_in_the_new_layout_and_keeping_a_tombstone():
    s, actions = run(blocked(), h.Decide(True))
    assert s.state is SourceState.HANDED
    assert actions == [h.ReleaseReplies(new_layout=True), h.KeepTombstone(12)]
    assert run(s, h.Decide(True)) == (s, [])


def test_decide_switch_before_the_source_voted_is_refused():
    s, _ = run(tailing(), h.Propose(10), h.Commit(12))
    refused(s, h.Decide(True), grpc.StatusCode.FAILED_PRECONDITION, "blocking", "not blocked")


def test_retire_frees_the_tombstone_once_the_destination_checkpointed_at_R_or_later():
    s, _ = run(blocked(), h.Decide(True))
    refused(s, h.Retire(dest_checkpoint=11), grpc.StatusCode.FAILED_PRECONDITION, "version 11", "R=12")
    s, actions = run(s, h.Retire(dest_checkpoint=12))
    assert s.state is SourceState.RETIRED and actions == [h.FreeTombstone()]
    s2, actions = run(blocked(), h.Decide(True), h.Retire(dest_checkpoint=None))  # checkpoints off
    assert s2.state is SourceState.RETIRED and actions[-1] == h.FreeTombstone()


@pytest.mark.parametrize("where", ["copying", "tailing", "holding", "blocking", "blocked"])
def test_decide_abort_before_the_switch_returns_the_range_to_its_owner_in_the_old_layout(where):
    s = {"copying": run(source(), h.Prepare(10))[0], "tailing": tailing(),
         "holding": run(tailing(), h.Propose(10))[0], "blocking": run(tailing(), h.Propose(10), h.Commit(12))[0],
         "blocked": blocked()}[where]
    s, actions = run(s, h.Decide(False))
    assert s.state is SourceState.OWNER and s.round is None
    assert actions[:3] == [h.ReleaseRounds(), h.ReleaseReplies(new_layout=False), h.DropMove()]
    assert counted(actions) == ["handoff_aborts"]


def test_decide_abort_after_the_switch_is_refused():
    s, _ = run(blocked(), h.Decide(True))
    refused(s, h.Decide(False), grpc.StatusCode.FAILED_PRECONDITION, "switched already")


# ============================================================================================ source: the commit
def test_commit_R_at_or_below_the_version_is_refused_late_naming_R_and_the_version():
    s, _ = run(tailing(), h.Propose(10))
    refused(s, h.Commit(10), grpc.StatusCode.FAILED_PRECONDITION, "commit round is 10", "version 10")


def test_commit_R_past_version_plus_3_is_refused_out_of_range():
    s, _ = run(tailing(), h.Propose(10))
    refused(s, h.Commit(14), grpc.StatusCode.OUT_OF_RANGE, "commit round is 14", "version 10", "at most 13")


def test_commit_below_the_sources_own_proposal_is_refused():
    s, _ = run(tailing(), h.Propose(10))
    s = replace(s, proposal=13)  # as if it had been a round ahead when it proposed
    refused(s, h.Commit(12), grpc.StatusCode.INVALID_ARGUMENT, "commit round is 12", "proposed 13")


def test_a_commit_after_the_hold_expired_is_still_taken_inside_the_window():
    s, _ = run(tailing(), h.Propose(10), now=0.0)
    s, _ = run(s, h.Tick(), now=TIMEOUT)
    s, actions = run(s, h.Commit(12))
    assert s.state is SourceState.BLOCKING and actions == [h.HoldReplies(12), h.HoldRounds(12)]


def test_a_second_commit_with_another_round_is_refused_naming_both():
    s, _ = run(tailing(), h.Propose(10), h.Commit(12))
    refused(s, h.Commit(13), grpc.StatusCode.FAILED_PRECONDITION, "13", "R=12")


# ============================================================================================ the forward lag
def test_a_round_closed_past_the_throttle_copies_the_range_again_at_the_version_now():
    s = tailing()
    s = replace(s, max_lag=3)
    s, actions = run(s, h.RoundClosed(10), h.RoundClosed(11), h.RoundClosed(12))  # 3 behind: still tailing
    assert s.state is SourceState.TAILING
    s, actions = run(s, h.RoundClosed(13))
    assert s.state is SourceState.COPYING and s.copied_at == 14
    assert h.TakeSnapshot(A, B, 14) in actions and counted(actions) == ["handoff_recopies"]


def test_a_destination_too_slow_while_holding_releases_the_hold_and_copies_again():
    s = replace(tailing(), max_lag=1)
    s, _ = run(s, h.Propose(10), h.RoundClosed(10))  # version 11, one behind: fine
    s = replace(s, max_lag=0)
    s, actions = run(s, h.ForwardAcked(9), h.RoundClosed(11))
    assert s.state is SourceState.COPYING and actions[0] == h.ReleaseRounds()


def test_a_destination_too_slow_after_the_commit_aborts_instead_of_stretching_the_block():
    s = replace(tailing(), max_lag=1)
    s, _ = run(s, h.Propose(10), h.Commit(12), h.RoundClosed(10))
    s, actions = run(s, h.RoundClosed(11))
    assert s.state is SourceState.OWNER and counted(actions) == ["handoff_aborts"]


# ============================================================================================ the throttle
def throttled(max_lag=3, now=100.0) -> tuple[SourceMove, list]:
    """Tailing at 10 with ``max_lag``; rounds closed until the destination is ``max_lag`` behind."""
    s = replace(tailing(), max_lag=max_lag)
    return run(s, *[h.RoundClosed(v) for v in range(10, 10 + max_lag)], now=now)


def test_at_max_forward_lag_behind_the_next_round_waits_for_the_forwards_and_is_counted():
    s, actions = run(replace(tailing(), max_lag=3), h.RoundClosed(10), h.RoundClosed(11))  # 2 behind: no throttle
    assert not [a for a in actions if isinstance(a, h.ThrottleRounds)] and s.throttled_since is None
    s, actions = run(s, h.RoundClosed(12), now=100.0)
    assert actions[:2] == [h.SendForward(12), h.ThrottleRounds(13)] and s.throttled_since == 100.0
    assert counted(actions) == ["handoff_rounds_throttled"] and "round 13 waits" in actions[-1].message


def test_a_forward_acknowledged_below_the_bound_lets_the_throttled_round_close():
    s, _ = throttled()
    s, actions = run(s, h.ForwardAcked(10))
    assert actions == [h.ThrottleRounds(None)] and s.throttled_since is None and s.state is SourceState.TAILING
    assert run(s, h.ForwardAcked(11))[1] == []  # released once


def test_rounds_closed_while_copying_throttle_at_the_bound_so_the_copy_is_never_outrun():
    s, actions = run(source(max_lag=2), h.Prepare(10), h.RoundClosed(10), h.RoundClosed(11))
    assert s.state is SourceState.COPYING and h.ThrottleRounds(12) in actions  # not copied again
    s, actions = run(s, h.CopyAcked(10), h.ForwardAcked(10))
    assert s.state is SourceState.TAILING and actions[-1] == h.ThrottleRounds(None)


def test_a_throttle_that_lasts_the_handoff_timeout_copies_again_and_lets_the_rounds_close():
    s, _ = throttled(now=100.0)
    assert run(s, h.Tick(), now=100.0 + TIMEOUT - 0.01) == (s, [])
    s, actions = run(s, h.Tick(), now=100.0 + TIMEOUT)
    assert s.state is SourceState.COPYING and s.copied_at == 13 and s.throttled_since is None
    assert actions[:2] == [h.ThrottleRounds(None), h.TakeSnapshot(A, B, 13)]
    assert counted(actions) == ["handoff_recopies"] and "--handoff-timeout" in actions[-1].message


def test_a_throttle_that_lasts_the_handoff_timeout_after_the_commit_aborts_and_releases_everything():
    s, _ = throttled(max_lag=2, now=100.0)  # version 12, throttled
    s, _ = run(s, h.Propose(12), h.Commit(14), now=100.0)
    s, actions = run(s, h.Tick(), now=100.0 + TIMEOUT)
    assert s.state is SourceState.OWNER and s.throttled_since is None
    assert h.ThrottleRounds(None) in actions and h.ReleaseRounds() in actions
    assert h.ReleaseReplies(new_layout=False) in actions and counted(actions) == ["handoff_aborts"]


def test_a_committed_move_does_not_throttle_round_R_which_the_commit_holds_already():
    s = replace(tailing(), max_lag=2)
    s, actions = run(s, h.Propose(10), h.Commit(12), h.RoundClosed(10), h.RoundClosed(11))
    assert s.version == 12 and not [a for a in actions if isinstance(a, h.ThrottleRounds)]


def test_decide_abort_while_throttled_lets_the_rounds_close_again():
    s, _ = throttled()
    s, actions = run(s, h.Decide(False))
    assert s.state is SourceState.OWNER and h.ThrottleRounds(None) in actions and s.throttled_since is None


def test_repeated_and_late_forward_acks_change_nothing():
    s, _ = run(tailing(), h.RoundClosed(10), h.ForwardAcked(10))
    assert run(s, h.ForwardAcked(10)) == (s, []) and run(s, h.ForwardAcked(9)) == (s, [])


# ============================================================================================ destination
def dest(**kw) -> DestPiece:
    return DestPiece(timeout=TIMEOUT, label="shard 2", **kw)


PARTS = ((500, 1_000), (1_000, 1_500))  # drawn from two sources


def replaying(v=10, to=12) -> DestPiece:
    d, _ = run(dest(), h.Prepare(parts=PARTS, need_bytes=100, available_bytes=1_000),
               h.PartCopied(0, v), h.PartCopied(1, v))
    for r in range(v, to):
        d, _ = run(d, h.Forwarded(0, r), h.Forwarded(1, r))
    return d


def ready(R=12) -> DestPiece:
    d, _ = run(replaying(to=R), h.SourceVote(0, R, "abc", "abc"), h.SourceVote(1, R, "def", "def"))
    return d


def test_prepare_admits_a_piece_whose_bytes_fit_the_budget():
    d, actions = run(dest(), h.Prepare(parts=PARTS, need_bytes=100, available_bytes=100))
    assert d.state is DestState.RECEIVING and d.versions == (None, None) and actions == []


def test_prepare_over_budget_is_refused_resource_exhausted_naming_both_byte_counts():
    refused(dest(), h.Prepare(parts=PARTS, need_bytes=101, available_bytes=100),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 101 bytes", "100 are available")


def test_every_part_copied_starts_the_replay_and_each_forward_of_a_part_is_one_step():
    d, _ = run(dest(), h.Prepare(parts=PARTS, need_bytes=1, available_bytes=1), h.PartCopied(0, 10))
    assert d.state is DestState.RECEIVING
    d, actions = run(d, h.PartCopied(1, 11))  # parts copied at different versions replay on their own
    assert d.state is DestState.REPLAYING and actions == [h.LoadPart(1, 11), h.AckCopy(1, 11)]
    d, actions = run(d, h.Forwarded(0, 10))
    assert actions == [h.ApplyForward(0, 10), h.AckForward(0, 10)] and d.version == 11


def test_a_repeated_forward_is_acknowledged_not_applied_and_counted():
    d, actions = run(replaying(), h.Forwarded(0, 11))
    assert actions[0] == h.AckForward(0, 11) and counted(actions) == ["handoff_forwards_repeated"]
    assert not [a for a in actions if isinstance(a, h.ApplyForward)]


def test_a_retried_forward_or_copy_at_a_ready_piece_is_acknowledged_and_changes_nothing():
    d = ready()
    assert run(d, h.Forwarded(0, 11))[1][0] == h.AckForward(0, 11)
    assert run(d, h.PartCopied(1, 10)) == (d, [h.AckCopy(1, 10)])
    assert run(replaying(), h.PartCopied(0, 10)) == (replaying(), [h.AckCopy(0, 10)])  # not rolled back to 10


def test_a_forward_with_a_gap_is_refused_naming_both_versions():
    refused(replaying(), h.Forwarded(0, 13), grpc.StatusCode.INVALID_ARGUMENT, "forward version is 13", "at 12")


def test_a_copy_taken_again_replaces_its_part():
    d, actions = run(replaying(), h.PartCopied(0, 14))
    assert d.versions == (14, 12) and actions == [h.LoadPart(0, 14), h.AckCopy(0, 14)]


def test_the_piece_is_ready_once_every_source_voted_with_the_digest_it_replayed():
    d, actions = run(replaying(), h.SourceVote(0, 12, "abc", "abc"))
    assert d.state is DestState.REPLAYING and actions == []
    d, actions = run(d, h.SourceVote(1, 12, "def", "def"))
    assert d.state is DestState.READY and d.round == 12 and actions == [h.SendVote(12, False)]


def test_a_digest_mismatch_votes_abort_and_drops_the_piece():
    d, actions = run(replaying(), h.SourceVote(0, 12, "abc", "abd"))
    assert d.state is DestState.DROPPED and actions[:2] == [h.SendVote(12, True), h.DropParts()]
    assert counted(actions) == ["handoff_digest_mismatches"]
    refused(d, h.Decide(True), grpc.StatusCode.FAILED_PRECONDITION, "aborted")


def test_a_vote_for_R_on_a_part_not_replayed_to_R_votes_abort():
    d, actions = run(replaying(to=11), h.SourceVote(0, 12, "abc", "abc"))
    assert d.state is DestState.DROPPED and "replayed to version 11" in actions[-1].message


def test_a_base_R_push_at_a_ready_piece_waits_for_decide_and_switch_serves_it():
    d, actions = run(ready(), h.PushArrived(12), now=7.0)
    assert actions == [h.WaitForDecide(12)] and d.waiting == 1 and d.deadline == 7.0 + TIMEOUT
    d, actions = run(d, h.Decide(True))
    assert d.state is DestState.SERVING and actions == [h.Serve(12)] and d.waiting == 0


@pytest.mark.parametrize("where", ["receiving", "replaying", "ready"])
def test_decide_abort_before_serving_drops_the_piece(where):
    d = {"receiving": run(dest(), h.Prepare(parts=PARTS, need_bytes=1, available_bytes=1))[0],
         "replaying": replaying(), "ready": ready()}[where]
    d, actions = run(d, h.Decide(False))
    assert d.state is DestState.DROPPED and actions[0] == h.DropParts() and counted(actions) == ["handoff_aborts"]


def test_decide_switch_before_ready_is_refused():
    refused(replaying(), h.Decide(True), grpc.StatusCode.FAILED_PRECONDITION, "replaying", "not ready")


# ============================================================================================ the failure table
@pytest.mark.parametrize("where", ["copying", "tailing", "holding"])
def test_a_source_killed_before_the_commit_restarts_owning_its_range_and_votes_abort(where):
    s = {"copying": run(source(), h.Prepare(10))[0], "tailing": tailing(),
         "holding": run(tailing(), h.Propose(10))[0]}[where]
    s, actions = run(s, h.Restarted())
    assert s.state is SourceState.OWNER and actions[0].abort and h.DropMove() in actions


def test_a_destination_whose_source_stream_broke_mid_copy_drops_its_parts_and_votes_abort():
    d, _ = run(dest(), h.Prepare(parts=PARTS, need_bytes=1, available_bytes=1), h.PartCopied(0, 10))
    d, actions = run(d, h.SourceLost(1))
    assert d.state is DestState.DROPPED and actions[0].abort and h.DropParts() in actions


def test_a_source_killed_committed_but_not_voted_votes_abort():
    s, _ = run(tailing(), h.Propose(10), h.Commit(12), h.RoundClosed(10))
    s, actions = run(s, h.Restarted())
    assert s.state is SourceState.OWNER and actions[0] == h.SendVote(12, True)


def test_a_source_killed_after_it_voted_stays_in_doubt_and_asks_its_peers():
    s, actions = run(blocked(), h.Restarted(), now=30.0)
    assert s.state is SourceState.BLOCKED and actions == [h.AskPeers()]


def test_a_source_killed_after_the_switch_serves_its_kept_range_from_its_last_checkpoint():
    s, _ = run(blocked(), h.Decide(True))
    s, actions = run(s, h.Restarted())
    assert s.state is SourceState.RETIRED and actions[0] == h.RecutKept(12)
    assert counted(actions) == ["handoff_tombstones_lost"]


def test_a_destination_killed_before_its_vote_restarts_empty_and_votes_abort():
    d, actions = run(replaying(), h.Restarted())
    assert d.state is DestState.EMPTY and actions[0] == h.SendVote(-1, True)
    refused(d, h.Decide(True), grpc.StatusCode.FAILED_PRECONDITION, "aborted")


def test_a_destination_killed_after_the_switch_is_reseeded_from_the_tombstone_at_R_without_replay():
    s, _ = run(blocked(), h.Decide(True))
    d, _ = run(ready(), h.Decide(True), h.Restarted())
    assert d.state is DestState.RESEEDING and d.versions == (None, None)
    s, actions = run(s, h.DestLost())
    assert actions[0] == h.Reseed(A, B, 12) and counted(actions) == ["handoff_reseeds"]
    refused(d, h.PartCopied(0, 11), grpc.StatusCode.INVALID_ARGUMENT, "version 11", "R=12")
    d, actions = run(d, h.PartCopied(0, 12), h.PartCopied(1, 12))
    assert d.state is DestState.SERVING and actions[-1] == h.Serve(12)
    assert not [a for a in actions if isinstance(a, h.ApplyForward)]


def test_a_destination_lost_once_the_tombstone_was_retired_is_not_reseeded():
    s, _ = run(blocked(), h.Decide(True), h.Retire(dest_checkpoint=12))
    assert run(s, h.DestLost()) == (s, [])


def test_a_destination_killed_while_ready_is_reseeded_if_the_decision_is_switch_or_dropped_if_abort():
    d, _ = run(ready(), h.Restarted())
    assert d.state is DestState.RESEEDING
    assert run(d, h.Decide(True))[0].state is DestState.RESEEDING
    assert run(d, h.Decide(False))[0].state is DestState.DROPPED


def test_retried_pushes_at_a_handed_source_answer_duplicate_stale_or_layout_moved():
    s, _ = run(blocked(), h.Decide(True))
    assert s.answer_push(base=11, acknowledged=True).kind == DUPLICATE
    stale = s.answer_push(base=11, acknowledged=False)  # stale-timeout: round 11 closed without it
    assert stale.kind == STALE and "never taken into round R" in stale.message
    moved = s.answer_push(base=12, acknowledged=False)
    assert moved.kind == LAYOUT_MOVED and "base version is 12" in moved.message and "R=12" in moved.message
    assert s.answer_pull(12).kind == APPLY and s.answer_pull(13).kind == LAYOUT_MOVED


def test_pushes_before_the_switch_are_decided_as_today_and_after_retirement_every_one_moved():
    assert blocked().answer_push(base=11, acknowledged=False).kind == APPLY
    s, _ = run(blocked(), h.Decide(True), h.Retire(dest_checkpoint=None))
    assert s.answer_push(base=11, acknowledged=True).kind == LAYOUT_MOVED


# ============================================================================================ termination
def test_a_blocked_source_past_its_deadline_asks_its_peers_and_counts_it():
    s = blocked(now=0.0)
    assert run(s, h.Tick(), now=TIMEOUT - 0.01) == (s, [])
    s, actions = run(s, h.Tick(), now=TIMEOUT)
    assert actions[0] == h.AskPeers() and counted(actions) == ["handoff_termination_queries"]
    assert s.deadline == 2 * TIMEOUT


def test_termination_a_peer_that_knows_switch_makes_the_source_switch():
    s, actions = run(blocked(), h.PeerAnswers((("shard 1", AGREE), ("shard 2", "switch"))))
    assert s.state is SourceState.HANDED and h.KeepTombstone(12) in actions


def test_termination_every_peer_agreeing_aborts():
    s, actions = run(blocked(), h.PeerAnswers((("shard 1", AGREE), ("shard 2", AGREE))))
    assert s.state is SourceState.OWNER and s.term.known is Known.ABORT and h.DropMove() in actions


def test_termination_a_peer_down_waits():
    s = blocked()
    after, actions = run(s, h.PeerAnswers((("shard 1", AGREE), ("shard 2", None))))
    assert after.state is SourceState.BLOCKED and actions == []


def test_termination_after_agreeing_to_abort_a_late_switch_is_refused():
    s, actions = run(blocked(), h.Query())
    assert actions == [h.Answer(AGREE)]
    refused(s, h.Decide(True), grpc.StatusCode.FAILED_PRECONDITION, "agreed to abort")
    d, _ = run(ready(), h.Query())
    refused(d, h.Decide(True), grpc.StatusCode.FAILED_PRECONDITION, "agreed to abort")


def test_termination_a_peer_that_agreed_but_was_not_followed_learns_the_switch_from_its_own_query():
    promised, _ = run(blocked(), h.Query())  # it agreed; another peer was down, so nobody aborted
    switched, _ = run(blocked(), h.Decide(True))  # the coordinator came back to the others
    _, answer = run(switched, h.Query())
    s, _ = run(promised, h.PeerAnswers((("shard 1", answer[0].answer),)))
    assert s.state is SourceState.HANDED


def test_a_ready_destination_holding_a_push_past_the_deadline_asks_its_peers():
    d, _ = run(ready(), h.PushArrived(12), now=0.0)
    assert run(d, h.Tick(), now=TIMEOUT - 0.01) == (d, [])
    d, actions = run(d, h.Tick(), now=TIMEOUT)
    assert actions[0] == h.AskPeers()
    d, actions = run(d, h.PeerAnswers((("shard 0", "switch"),)))
    assert d.state is DestState.SERVING and actions == [h.Serve(12)]


# ============================================================================================ the job
def test_a_whole_handoff_from_two_sources_to_one_piece_switches_at_the_largest_proposal():
    s0, s1 = tailing(10), tailing(10)
    d, _ = run(dest(), h.Prepare(parts=PARTS, need_bytes=1, available_bytes=1), h.PartCopied(0, 10),
               h.PartCopied(1, 10))
    s0, _ = run(s0, h.Propose(10))
    s1, _ = run(s1, h.RoundClosed(10), h.ForwardAcked(10), h.Propose(11))
    d, _ = run(d, h.Forwarded(1, 10))
    R = max(s0.proposal, s1.proposal)  # the largest proposal of every source (the join's rule)
    assert R == 11 + JOIN_LEAD
    s0, s1 = run(s0, h.Commit(R))[0], run(s1, h.Commit(R))[0]
    for part, (s, first) in enumerate(((s0, 10), (s1, 11))):
        for r in range(first, R):
            s, _ = run(s, h.RoundClosed(r))
            d, _ = run(d, h.Forwarded(part, r))
            s, _ = run(s, h.ForwardAcked(r))
        assert s.state is SourceState.BLOCKED
        d, _ = run(d, h.SourceVote(part, R, "same", "same"))
        s0, s1 = (s, s1) if part == 0 else (s0, s)
    assert d.state is DestState.READY  # every source blocked at R, the piece replayed it: ready to switch
    s0, s1, d = (run(x, h.Decide(True))[0] for x in (s0, s1, d))
    assert d.state is DestState.SERVING
    s0, s1 = (run(x, h.Retire(dest_checkpoint=R))[0] for x in (s0, s1))
    assert s0.state is SourceState.RETIRED and s1.state is SourceState.RETIRED
