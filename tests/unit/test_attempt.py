"""The step attempt's decisions (trainer.stepping.attempt): pure, no network, as psserver.protocol.rules' are."""

import grpc

from psserver.protocol.errors import JobMismatch, LayoutAhead, LayoutMoved
from trainer.stepping.attempt import LOST, Move, StepAttempt, after_rejoin, rejoins_on, slot_move
from trainer.channels.client import PushOutcome


def ack(outcome="applied", version=3):
    return PushOutcome(outcome=outcome, version=version, staleness=0)


def test_a_slot_answered_in_an_earlier_try_only_pulls_whatever_else_is_known():
    assert all(slot_move(answered=True, started=s, overlap=o) == Move.PULL for s in (0, 1) for o in (0, 1))


def test_a_push_already_started_is_awaited_before_any_new_push():
    assert slot_move(answered=False, started=True, overlap=False) == Move.AWAIT
    assert slot_move(answered=False, started=True, overlap=True) == Move.AWAIT


def test_a_fresh_slot_pushes_and_pulls_in_one_call_unless_overlap_pulls_in_the_background():
    assert slot_move(answered=False, started=False, overlap=False) == Move.PUSH_PULL
    assert slot_move(answered=False, started=False, overlap=True) == Move.PUSH


class _Error(grpc.RpcError):
    """An RpcError as a shard's refusal ``e`` arrives: its code and its trailers."""

    def __init__(self, e=None, code=None):
        self._code, self._trailers = (e.code, e.trailers()) if e is not None else (code, ())

    def code(self):
        return self._code

    def trailing_metadata(self):
        return self._trailers


def test_only_the_restart_codes_rejoin_and_a_rejoined_slot_pushes_again_or_is_lost():
    assert rejoins_on(_Error(code=grpc.StatusCode.NOT_FOUND)) and rejoins_on(_Error(JobMismatch("fingerprint")))
    assert rejoins_on(_Error(code=grpc.StatusCode.OUT_OF_RANGE))
    assert not rejoins_on(_Error(code=grpc.StatusCode.UNAVAILABLE))
    assert not rejoins_on(_Error(code=grpc.StatusCode.ALREADY_EXISTS))
    assert after_rejoin(push_again=True) is None and after_rejoin(push_again=False) == LOST


def test_a_layout_moved_or_layout_ahead_refusal_is_not_a_restart_although_its_code_is_a_restart_code():
    moved, ahead = _Error(LayoutMoved("layout_epoch is 0", newest=1)), _Error(LayoutAhead("layout_epoch is 3"))
    assert (moved.code(), ahead.code()) == (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)
    assert not rejoins_on(moved) and not rejoins_on(ahead)


def test_an_answer_that_arrived_before_an_interrupt_is_taken_only_if_it_is_this_steps_number():
    attempt = StepAttempt(todo={0, 1}, sequences={0: 7, 1: 9})
    assert attempt.answered(0, (6, ack())) is None  # the previous step's answer
    assert attempt.answered(0, None) is None
    assert attempt.answered(0, (7, ack(version=4))).version == 4 and attempt.acks[0].version == 4
    assert attempt.answered(0, (7, ack(version=5))).version == 4  # recorded once: the first stays


def test_recording_outcomes_tells_which_slots_hold_the_gradient():
    attempt = StepAttempt(todo={0, 1, 2, 3}, acks={1: ack(), 2: ack()}, timings={2: (1.0, 1.0, 1.0)})
    attempt.record(0, "applied")
    attempt.record(2, LOST)
    assert attempt.todo == {1, 3} and 2 not in attempt.acks and attempt.timings[2] == (0.0, 0.0, 0.0)
    assert attempt.applied() == [0, 1]  # 1 acknowledged, its pull still to do; 2 lost
    attempt.record(1, "stale")
    assert attempt.applied() == [0]


def test_a_rejoined_slot_forgets_its_push_so_the_next_one_gets_a_new_number():
    attempt = StepAttempt(todo={0}, acks={0: ack()}, sequences={0: 4})
    attempt.forget_push(0)
    assert attempt.acks == {} and attempt.sequences == {}
