"""Each mode's decisions, with a clock value and a state: no gRPC, no threads."""

from psserver.state.modes import Action, CloseReason, ModeConfig, RoundView, decide_push, decide_tick, round_deadline

SYNC = ModeConfig("sync")
ASYNC = ModeConfig("async")
ASYNC_S2 = ModeConfig("async", max_staleness=2)
ST = ModeConfig("stale-timeout", sync_timeout=0.5)
ST_K = ModeConfig("stale-timeout", sync_timeout=0.5, replicas_to_aggregate=2)
ST_SCALE = ModeConfig("stale-timeout", sync_timeout=0.5, stale_policy="scale")
LIVE3 = frozenset({0, 1, 2})


def test_sync_waits_for_every_live_trainer_then_closes():
    view = RoundView(version=4, live=LIVE3)
    d = decide_push(SYNC, view, rank=0, base=4, now=0.0)
    assert d.action is Action.ACCUMULATE and d.close is None
    view = RoundView(version=4, live=LIVE3, contributors=frozenset({0, 1}), opened_at=0.0)
    assert decide_tick(SYNC, view, now=1e9) is None  # sync never times out
    d = decide_push(SYNC, view, rank=2, base=4, now=5.0)
    assert d.action is Action.ACCUMULATE and d.close is CloseReason.ALL_ARRIVED


def test_sync_does_not_close_before_every_trainer_of_the_job_registered():
    view = RoundView(version=0, live=frozenset({0}), started=False)
    assert decide_push(SYNC, view, rank=0, base=0, now=0.0).close is None


def test_sync_round_closes_when_the_missing_trainer_leaves_and_says_why():
    view = RoundView(version=1, live=frozenset({0, 1}), contributors=frozenset({0, 1}), opened_at=0.0)
    assert decide_tick(SYNC, view, now=0.0) is CloseReason.MEMBERSHIP
    view = RoundView(version=1, live=frozenset({0, 1, 2}), contributors=frozenset({0, 1}), opened_at=0.0)
    assert decide_tick(SYNC, view, now=0.0) is None


def test_sync_refuses_stale_and_future_and_acknowledges_duplicates():
    view = RoundView(version=4, live=LIVE3, contributors=frozenset({1}), opened_at=0.0)
    assert decide_push(SYNC, view, rank=0, base=3, now=0).action is Action.DROP_STALE
    assert decide_push(SYNC, view, rank=0, base=5, now=0).action is Action.REFUSE_FUTURE
    assert decide_push(SYNC, view, rank=1, base=4, now=0).action is Action.DUPLICATE


def test_async_applies_every_push_and_records_staleness():
    view = RoundView(version=10, live=LIVE3)
    d = decide_push(ASYNC, view, rank=1, base=7, now=0)
    assert d.action is Action.APPLY and d.staleness == 3


def test_async_max_staleness_bound():
    view = RoundView(version=10, live=LIVE3)
    assert decide_push(ASYNC_S2, view, rank=1, base=8, now=0).action is Action.APPLY
    d = decide_push(ASYNC_S2, view, rank=1, base=7, now=0)
    assert d.action is Action.DROP_STALE and d.staleness == 3


def test_async_duplicate_of_an_applied_push_is_not_applied_twice():
    view = RoundView(version=10, live=LIVE3, last_base={1: 9})
    assert decide_push(ASYNC, view, rank=1, base=9, now=0).action is Action.DUPLICATE
    assert decide_push(ASYNC, view, rank=1, base=10, now=0).action is Action.APPLY


def test_stale_timeout_closes_at_the_timeout_not_before():
    view = RoundView(version=2, live=LIVE3, contributors=frozenset({0}), opened_at=100.0)
    assert round_deadline(ST, view) == 100.5
    assert decide_tick(ST, view, now=100.49) is None
    assert decide_tick(ST, view, now=100.5) is CloseReason.TIMEOUT


def test_stale_timeout_deadline_starts_at_the_first_gradient():
    d = decide_push(ST, RoundView(version=0, live=LIVE3), rank=2, base=0, now=7.0)
    assert d.action is Action.ACCUMULATE and d.close is None
    assert round_deadline(ST, RoundView(version=0, live=LIVE3)) is None  # no gradient yet: no deadline


def test_stale_timeout_closes_at_k_replicas():
    view = RoundView(version=2, live=LIVE3, contributors=frozenset({0}), opened_at=0.0)
    d = decide_push(ST_K, view, rank=1, base=2, now=0.1)
    assert d.close is CloseReason.QUORUM
    assert decide_push(ST, view, rank=1, base=2, now=0.1).close is None  # without K: waits for rank 2


def test_stale_timeout_closes_early_when_all_arrive():
    view = RoundView(version=2, live=LIVE3, contributors=frozenset({0, 1}), opened_at=0.0)
    assert decide_push(ST, view, rank=2, base=2, now=0.1).close is CloseReason.ALL_ARRIVED


def test_late_gradient_is_dropped_under_drop_policy():
    view = RoundView(version=5, live=LIVE3)
    d = decide_push(ST, view, rank=2, base=4, now=0)
    assert d.action is Action.DROP_STALE and d.staleness == 1


def test_late_gradient_is_scaled_by_one_over_one_plus_staleness_under_scale_policy():
    view = RoundView(version=5, live=LIVE3)
    d = decide_push(ST_SCALE, view, rank=2, base=2, now=0)
    assert d.action is Action.ACCUMULATE and d.weight == 1 / 4 and d.staleness == 3
    assert not d.counts_for_round and d.close is None
    again = RoundView(version=5, live=LIVE3, stale_in_round=frozenset({(2, 2)}), opened_at=0.0)
    assert decide_push(ST_SCALE, again, rank=2, base=2, now=0).action is Action.DUPLICATE


def test_round_holding_only_scaled_gradients_closes_only_by_timeout():
    view = RoundView(version=5, live=frozenset({2}), stale_in_round=frozenset({(2, 2)}), opened_at=0.0)
    assert decide_tick(ST_SCALE, view, now=0.1) is None
    assert decide_tick(ST_SCALE, view, now=0.6) is CloseReason.TIMEOUT


def test_duplicate_fresh_push_in_stale_timeout_is_not_applied_twice():
    view = RoundView(version=5, live=LIVE3, contributors=frozenset({0}), opened_at=0.0)
    assert decide_push(ST, view, rank=0, base=5, now=0.2).action is Action.DUPLICATE


def test_lease_expires_only_after_the_timeout_and_only_for_silent_ranks():
    from psserver.state.modes import expired_ranks, next_lease_expiry

    live, seen = frozenset({0, 1}), {0: 10.0, 1: 12.0}
    assert next_lease_expiry(live, seen, lease=5.0) == 15.0
    assert expired_ranks(live, seen, lease=5.0, now=15.0) == frozenset()
    assert expired_ranks(live, seen, lease=5.0, now=15.5) == frozenset({0})
    assert expired_ranks(live, seen, lease=5.0, now=17.5) == frozenset({0, 1})
    assert expired_ranks(live, seen, lease=0.0, now=1e9) == frozenset()  # leases off
    assert next_lease_expiry(frozenset(), seen, lease=5.0) is None


# ---------------------------------------------------------------------- every action a push needs
from psserver.protocol.limits import MAX_PUSH_WINDOW, MAX_SEQUENCE  # noqa: E402
from psserver.state.modes import (  # noqa: E402
    MAX_SEQUENCE_GAP,
    SequenceAction,
    decide_sequence,
    holes_after,
    reply_version,
    round_takes_step,
)


def test_sequence_first_push_is_new_and_its_retry_a_duplicate():
    assert decide_sequence(None, 1) is SequenceAction.NEW
    assert decide_sequence(1, 1) is SequenceAction.DUPLICATE
    assert decide_sequence(1, 2) is SequenceAction.NEW


def test_sequence_older_than_the_window_or_implausibly_far_ahead_is_refused():
    assert decide_sequence(100, 100 - MAX_PUSH_WINDOW) is SequenceAction.REFUSE
    assert decide_sequence(5, 5 + MAX_SEQUENCE_GAP) is SequenceAction.NEW
    assert decide_sequence(5, 6 + MAX_SEQUENCE_GAP) is SequenceAction.REFUSE


def test_sequence_overtaken_in_flight_is_new_once_and_a_seen_one_below_the_newest_a_duplicate():
    assert decide_sequence(7, 5, holes=frozenset({5, 6})) is SequenceAction.NEW  # 7 overtook 5 and 6
    assert decide_sequence(7, 4, holes=frozenset({5, 6})) is SequenceAction.DUPLICATE  # 4 was acknowledged
    assert holes_after(4, frozenset(), 7) == {5, 6}
    assert holes_after(7, frozenset({5, 6}), 5) == {6}  # 5 arrived late: applied once, its hole filled
    assert holes_after(7, frozenset({6}), 6) == frozenset()
    assert holes_after(None, frozenset(), 3) == {1, 2}  # a first push that overtook the two before it


def test_sequence_holes_are_bounded_by_the_window_even_after_a_long_gap():
    holes = holes_after(1, frozenset(), 1 + 10 * MAX_PUSH_WINDOW)
    assert len(holes) == MAX_PUSH_WINDOW - 1 and max(holes) == 10 * MAX_PUSH_WINDOW
    assert holes_after(1 + 10 * MAX_PUSH_WINDOW, holes, 1 + 11 * MAX_PUSH_WINDOW).isdisjoint(holes)


def test_sequence_zero_or_past_the_cap_is_refused_even_as_a_first_push():
    assert decide_sequence(None, 0) is SequenceAction.REFUSE
    assert decide_sequence(None, MAX_SEQUENCE + 1) is SequenceAction.REFUSE
    assert decide_sequence(None, 2**64 - 1) is SequenceAction.REFUSE
    assert decide_sequence(None, MAX_SEQUENCE) is SequenceAction.NEW


def test_nonfinite_gradient_is_skipped_in_async_and_fills_its_slot_in_a_sync_round():
    d = decide_push(ASYNC, RoundView(version=3, live=LIVE3), rank=0, base=3, now=0, finite=False)
    assert d.action is Action.SKIP
    view = RoundView(version=3, live=LIVE3, contributors=frozenset({1, 2}), opened_at=0.0)
    d = decide_push(SYNC, view, rank=0, base=3, now=0, finite=False)
    assert d.action is Action.SKIP_IN_ROUND and d.close is CloseReason.ALL_ARRIVED


def test_nonfinite_stale_gradient_under_scale_policy_is_skipped_without_filling_a_slot():
    d = decide_push(ST_SCALE, RoundView(version=3, live=LIVE3), rank=0, base=2, now=0, finite=False)
    assert d.action is Action.SKIP


def test_nonfinite_stale_or_duplicate_keeps_its_refusal():
    view = RoundView(version=3, live=LIVE3, contributors=frozenset({1}), opened_at=0.0)
    assert decide_push(SYNC, view, rank=0, base=2, now=0, finite=False).action is Action.DROP_STALE
    assert decide_push(SYNC, view, rank=1, base=3, now=0, finite=False).action is Action.DUPLICATE


def test_sequenced_async_pushes_may_repeat_a_base_version():
    view = RoundView(version=10, live=LIVE3, last_base={1: 9})
    assert decide_push(ASYNC, view, rank=1, base=9, now=0, sequenced=True).action is Action.APPLY
    assert decide_push(ASYNC, view, rank=1, base=9, now=0, sequenced=False).action is Action.DUPLICATE


def test_a_round_of_only_skipped_gradients_advances_without_a_step():
    assert round_takes_step(0.0) is False
    assert round_takes_step(4.0) is True


def test_reply_waits_for_the_round_close_in_sync_modes_and_for_nothing_in_async():
    assert reply_version(SYNC, "accepted", base=4, version_after=4) == 5
    assert reply_version(SYNC, "duplicate", base=4, version_after=6) == 5  # a retry after its round closed
    assert reply_version(ST, "scaled", base=2, version_after=4) == 3
    assert reply_version(ASYNC, "applied", base=4, version_after=9) == 9
    assert reply_version(SYNC, "stale", base=2, version_after=4) == 4  # catch up with the current weights


def test_stale_timeout_round_closed_by_a_tick_says_timeout_not_membership():
    view = RoundView(version=1, live=LIVE3, contributors=frozenset({0}), opened_at=0.0)
    assert decide_tick(ST, view, now=0.1) is None
    assert decide_tick(ST, view, now=0.5) is CloseReason.TIMEOUT
