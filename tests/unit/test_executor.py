"""The one executor (psserver.state.executor) on a recording target, without tensors or network: what each
decision of psserver.state.modes does to a round, what is counted and what the pusher is answered.  The dense
slice and the served tables are this code's two callers (their own tests check their hooks)."""

import pytest

from psserver.protocol.errors import InvalidRequest
from psserver.state import modes
from psserver.state.executor import PushInfo, PushTarget, check_sequence, execute, record_ack
from psserver.state.rounds import OpenRound

A, CR = modes.Action, modes.CloseReason


class Refused(Exception):
    pass


class Recorder(PushTarget):
    def __init__(self):
        self.round, self.version, self.log = OpenRound(), 5, []

    def count_event(self, event):
        self.log.append(("count", event))

    def future(self, base):
        return Refused(f"future {base}")

    def stale(self, base, staleness):
        return Refused(f"stale {base} by {staleness}")

    def result(self, outcome, staleness, **extra):
        return (outcome, self.version, staleness)

    def skipped(self, push):
        self.log.append(("skipped", push.rank))

    def apply_now(self, push, staleness):
        self.version += 1
        return self.result("applied", staleness)

    def accumulate(self, push, weight):
        self.log.append(("add", push.rank, weight))
        return "spare buffer"

    def close_round(self, reason):
        self.version += 1
        self.log.append(("close", reason))

    def duplicate(self, push):
        self.log.append(("duplicate", push.rank))

    def scaled_in(self, push, factor):
        self.log.append(("scaled", push.rank, factor))

    def round_changed(self):
        self.log.append(("changed",))


def push(rank=1, base=5, samples=32):
    return PushInfo(rank, base, samples, sequenced=True)


def test_an_accumulated_push_joins_the_round_and_is_accepted_and_the_one_that_closes_it_is_applied():
    t = Recorder()
    result, back = execute(t, modes.PushDecision(A.ACCUMULATE), push(rank=0), now=10.0)
    assert result == ("accepted", 5, 0) and back == "spare buffer"
    assert t.round.contributors == {0} and t.round.opened_at == 10.0
    result, _ = execute(t, modes.PushDecision(A.ACCUMULATE, close=CR.ALL_ARRIVED), push(rank=1), now=11.0)
    assert result == ("applied", 6, 0)  # answered at the version its round closed to
    assert t.log == [("add", 0, 32.0), ("changed",), ("add", 1, 32.0), ("close", CR.ALL_ARRIVED), ("changed",)]
    assert t.round.opened_at == 10.0  # the first gradient opened it


def test_a_stale_push_scaled_into_the_round_is_booked_as_stale_not_as_a_contributor():
    t = Recorder()
    result, _ = execute(t, modes.PushDecision(A.ACCUMULATE, weight=0.5, staleness=2, counts_for_round=False),
                        push(rank=2, base=3), now=1.0)
    assert result == ("scaled", 5, 2)
    assert t.round.contributors == set() and t.round.stale == {(2, 3)}
    assert ("add", 2, 16.0) in t.log and ("scaled", 2, 0.5) in t.log


def test_a_dropped_stale_push_raises_the_targets_refusal_and_is_counted_and_changes_no_round():
    t = Recorder()
    with pytest.raises(Refused, match="stale 2 by 3"):
        execute(t, modes.PushDecision(A.DROP_STALE, staleness=3), push(base=2), now=1.0)
    assert t.log == [("count", "stale_dropped")] and t.round.opened_at is None and t.version == 5


def test_a_skipped_push_in_a_sync_round_still_counts_as_its_ranks_arrival_and_may_close_the_round():
    t = Recorder()
    result, back = execute(t, modes.PushDecision(A.SKIP_IN_ROUND, close=CR.ALL_ARRIVED), push(rank=3), now=2.0)
    assert result == ("skipped", 6, 0) and back is None
    assert t.round.contributors == {3}
    assert t.log == [("count", "skipped"), ("skipped", 3), ("close", CR.ALL_ARRIVED), ("changed",)]


def test_async_applies_alone_and_a_duplicate_base_is_answered_without_touching_anything():
    t = Recorder()
    assert execute(t, modes.PushDecision(A.APPLY, staleness=1), push(), now=0.0) == (("applied", 6, 1), None)
    assert execute(t, modes.PushDecision(A.DUPLICATE), push(rank=4), now=0.0) == (("duplicate", 6, 0), None)
    assert t.log == [("duplicate", 4)] and t.round.opened_at is None
    with pytest.raises(Refused, match="future 9"):
        execute(t, modes.PushDecision(A.REFUSE_FUTURE), push(base=9), now=0.0)


class Answer:
    def __init__(self, outcome):
        self.outcome = outcome


def test_exactly_once_a_sequence_sent_again_is_a_duplicate_and_one_out_of_order_is_refused_naming_where():
    acked = {}
    assert not check_sequence(acked, 0, "t0", 1)
    record_ack(acked, 0, "t0", 1, Answer("accepted"))
    assert check_sequence(acked, 0, "t0", 1)  # the retry after a lost reply
    assert not check_sequence(acked, 0, "t0", 2)
    assert not check_sequence(acked, 0, "new-process", 1)  # another trainer id starts afresh
    with pytest.raises(InvalidRequest, match=r"sequence is 0 but rank 0's last acknowledged push to table 'emb' "
                                             r"was 1: it must be the next few"):
        check_sequence(acked, 0, "t0", 0, where=" to table 'emb'")
    record_ack(acked, 0, "t0", 2, Answer("duplicate"))  # a duplicate's answer is no new acknowledgement
    assert acked[0][1] == 1


def test_exactly_once_a_push_overtaken_in_its_window_is_applied_once_and_then_answered_duplicate():
    acked, holes = {}, {}
    record_ack(acked, 0, "t0", 1, Answer("applied"), holes)
    assert not check_sequence(acked, 0, "t0", 3, holes=holes)
    record_ack(acked, 0, "t0", 3, Answer("applied"), holes)  # 3 overtook 2 on the way
    assert holes == {0: {2}} and acked[0][1] == 3
    assert not check_sequence(acked, 0, "t0", 2, holes=holes)  # 2 arrives: new, applied once
    record_ack(acked, 0, "t0", 2, Answer("applied"), holes)
    assert holes == {} and acked[0][1] == 3  # the newest stays 3
    assert check_sequence(acked, 0, "t0", 2, holes=holes)  # its retry after a lost reply: a duplicate
    with pytest.raises(InvalidRequest, match="sequence is 2 but rank 0's last acknowledged push was 3"):
        check_sequence(acked, 0, "t0", 2)  # a target that keeps no holes (the tables): one push at a time
