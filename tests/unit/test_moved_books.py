"""The push books that move with a range (psserver.resharding.handoff.moved_books) and the trainer's side of a slot lost after its
vote (trainer.stepping.lost_slots, trainer.stepping.attempt.lost_past_switch): pure decisions, no network."""

from types import SimpleNamespace

import grpc
import pytest

from psserver.protocol.errors import InvalidRequest, NotReady, StaleGradient
from psserver.resharding.handoff.moved_books import MovedBooks, book_of, check_book, moved_outcome
from psserver.state.push_book import PushBook, PushResult
from trainer.stepping.attempt import lost_past_switch
from trainer.stepping.lost_slots import new_owners

BOOK = {0: ("t0", 7, "applied"), 1: ("t1", 5, "accepted"), 2: ("t2", 9, "skipped")}


@pytest.mark.parametrize("rank, trainer_id, sequence, applied", [
    (0, "t0", 7, True),  # the newest acknowledged push, applied in round R-1
    (0, "t0", 6, True),  # an earlier one, acknowledged before it
    (1, "t1", 5, True),  # accepted into round R-1, which closed before the vote: in the average
    (0, "t0", 8, False),  # never read there: round R-1 closed without it (a lease that expired)
    (0, "t0-new", 7, False),  # another process on the rank: its numbers are not the book's
    (2, "t2", 9, False),  # skipped (non-finite): not in the average
    (3, "t3", 1, False),  # a rank the book never saw
])
def test_a_moved_book_holds_a_push_only_if_that_trainer_process_had_it_acknowledged_as_applied(
        rank, trainer_id, sequence, applied):
    assert moved_outcome(BOOK, rank, trainer_id, sequence) is applied


def test_a_slots_book_as_its_vote_carries_it_is_the_push_books_newest_record_per_rank_and_passes_the_wire_check():
    pushes = PushBook()
    pushes.record(0, "t0", 1, PushResult("applied", 3, 0))
    pushes.record(0, "t0", 2, PushResult("applied", 4, 0))
    pushes.record(1, "t1", 1, PushResult("accepted", 3, 0))
    book = book_of(pushes)
    assert book == {0: ("t0", 2, "applied"), 1: ("t1", 1, "accepted")}
    check_book(book)


@pytest.mark.parametrize("book", [None, {0: ("t0", 1)}, {"0": ("t0", 1, "applied")}, {0: ("t0", -1, "applied")},
                                  {0: ["t0", 1, "applied"]}])
def test_a_vote_whose_book_is_not_ranks_to_trainer_sequence_outcome_is_invalid_argument_naming_book(book):
    with pytest.raises(InvalidRequest, match="book is .* but it must map ranks to"):
        check_book(book)


class _Part:
    """What MovedBooks.answer reads of a partition: its version and the member check."""

    def __init__(self, version=8):
        self.version, self.checked = version, []

    def check_member(self, rank, trainer_id, fingerprint, need_params=False):
        self.checked.append((rank, trainer_id, fingerprint))


def _asked(**kw):
    h = dict(moved_from=3, layout_epoch=1, partition=0, version=7, rank=0, trainer_id="t0", fingerprint="f",
             sequence=7, length=0)
    return SimpleNamespace(**{**h, **kw})


@pytest.fixture
def books():
    b = MovedBooks()
    b.keep(1, 8, {0: {2: BOOK}})  # layout 1 from R=8; new partition 0 drew from old slot 2
    return b


def test_the_new_owner_answers_duplicate_for_a_push_in_the_moved_book_after_the_member_check(books):
    part = _Part()
    assert books.answer(part, _asked()) is True
    assert part.checked == [(0, "t0", "f")]


def test_the_new_owner_answers_stale_at_its_version_for_a_push_the_old_round_closed_without(books):
    with pytest.raises(StaleGradient, match="round 7 closed without rank 0's push numbered 8") as e:
        books.answer(_Part(version=8), _asked(sequence=8))
    assert (e.value.version, e.value.staleness) == (8, 1)


@pytest.mark.parametrize("asked, fragment", [
    (dict(moved_from=1), "moved_from is 1 (old slot 0) but layout 1 partition 0 here holds the books of old slots [2]"),
    (dict(layout_epoch=2), "moved_from is 3 (old slot 2) but layout 2 partition 0"),
    (dict(partition=1), "layout 1 partition 1 here holds the books of old slots []"),
    (dict(version=6), "base version is 6 but old slot 2's book here is of round 7 (R-1) only"),
])
def test_a_question_for_a_slot_layout_or_base_without_a_book_here_is_failed_precondition_naming_both(
        books, asked, fragment):
    with pytest.raises(NotReady) as e:
        books.answer(_Part(), _asked(**asked))
    assert fragment in str(e.value)


def test_a_question_that_carries_a_gradient_is_invalid_argument_naming_length(books):
    with pytest.raises(InvalidRequest, match="length is 5 but a push naming moved_from carries no gradient: 0"):
        books.answer(_Part(), _asked(length=5))


def test_the_books_are_dropped_when_the_next_plan_is_prepared(books):
    books.clear()
    with pytest.raises(NotReady):
        books.answer(_Part(), _asked())


class _Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "no answer"


def test_a_step_some_slots_applied_and_the_rest_could_not_reach_goes_to_the_lost_slots_new_owners():
    down = _Err(grpc.StatusCode.UNAVAILABLE)
    assert lost_past_switch({2: down}, [0, 1]) == [2]
    assert lost_past_switch({2: down, 1: _Err(grpc.StatusCode.DEADLINE_EXCEEDED)}, [0]) == [1, 2]
    assert lost_past_switch({2: down}, []) is None  # none applied: moved_past_unreachable's case, or a failure
    assert lost_past_switch({2: _Err(grpc.StatusCode.FAILED_PRECONDITION)}, [0, 1]) is None  # a real refusal
    assert lost_past_switch({2: RuntimeError("x")}, [0, 1]) is None
    assert lost_past_switch({}, [0, 1]) is None


def test_the_new_owners_of_an_old_slot_are_the_new_slots_overlapping_its_range():
    assert new_owners((666, 1000), [(0, 500), (500, 1000)]) == [1]  # 3 -> 2: old slot 2
    assert new_owners((333, 666), [(0, 500), (500, 1000)]) == [0, 1]
    assert new_owners((0, 500), [(0, 333), (333, 666), (666, 1000)]) == [0, 1]  # 2 -> 3
    assert new_owners((5, 5), [(0, 10)]) == []  # an empty range has no owner


class _Owner:
    """A new slot's dense calls whose ask_moved fails ``fails`` times (its retry budget spent), then answers."""

    calls = 0

    def __init__(self, answer="duplicate", fails=0):
        self.answer, self.fails = answer, fails

    def ask_moved(self, old_slot, sequence, base, wire, length, timeout, out):
        self.calls += 1
        if self.fails:
            self.fails -= 1
            raise _Err(grpc.StatusCode.UNAVAILABLE)
        out.fill_(7.0)  # the new owner's weights at R
        return SimpleNamespace(outcome=self.answer, version=base + 1)


def _exchange(owner):
    import torch

    from trainer.stepping.attempt import StepAttempt

    counts = {}
    flat = torch.zeros(4)
    client = SimpleNamespace(parts=[SimpleNamespace(address="new:1", dense=owner)], wire=0,
                             count=lambda name, n=1: counts.__setitem__(name, counts.get(name, 0) + n))
    slots = SimpleNamespace(client=client, flat=SimpleNamespace(flat=flat), versions=[8], slice=lambda f, n: f,
                            staging=SimpleNamespace(weights_buffer=lambda n, t: t, weights_to_device=lambda n, t: None))
    attempt = StepAttempt(todo={2}, outcomes={0: "applied", 1: "applied"})
    attempt.lost = {2: (7, 5, [0], "UNAVAILABLE")}  # old slot 2: base 7, its push numbered 5, new slot 0 owns it
    ex = SimpleNamespace(slots=slots, attempt=attempt, steps=3, round_timeout=1.0, counts=counts, flat=flat)
    ex.finished = lambda a, wall: ("finished", dict(a.outcomes))
    return ex


@pytest.mark.parametrize("answer, counter", [("duplicate", "steps_answered_by_new_owners"),
                                             ("stale", "steps_dropped_past_unreachable")])
def test_a_lost_slots_question_answered_finishes_the_step_with_that_answer_counted_and_the_owners_weights(
        answer, counter):
    from trainer.stepping.lost_slots import ask_lost

    ex = _exchange(_Owner(answer))
    relayout = SimpleNamespace(session=SimpleNamespace(rank=0), epoch=1)
    assert ask_lost(relayout, ex) == ("finished", {0: "applied", 1: "applied", 2: answer})
    assert ex.counts == {counter: 1} and ex.attempt.lost is None and ex.slots.versions == [8]
    assert ex.flat.tolist() == [7.0] * 4


def test_a_lost_slots_question_that_fails_too_is_a_counted_step_failure_and_the_next_step_asks_again():
    from trainer.stepping.attempt import StepFailed
    from trainer.stepping.lost_slots import ask_lost

    owner = _Owner(fails=1)
    ex = _exchange(owner)
    relayout = SimpleNamespace(session=SimpleNamespace(rank=0), epoch=1)
    with pytest.raises(StepFailed):
        ask_lost(relayout, ex)
    assert ex.counts == {"steps_failed": 1} and ex.attempt.lost == {2: (7, 5, [0], "UNAVAILABLE")}
    assert ask_lost(relayout, ex)[1][2] == "duplicate" and owner.calls == 2
