"""Push numbering (trainer.channels.push_numbers), without network: the decisions exactly-once rests on, made once for
a dense slice (trainer.channels.dense_push.OutgoingPush) and a table lane (trainer.tables.row_lanes)."""

import threading
from collections import Counter

import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from trainer.channels.dense_push import OutgoingPush
from trainer.channels.push_numbers import PushNumbers
from trainer.tables.row_lanes import Lane, Pending, RowLanes


def test_a_push_whose_reply_was_lost_is_sent_again_under_the_same_number():
    n = PushNumbers()
    assert n.number() == 1
    assert n.unanswered and n.upcoming() == 1
    assert n.number() == 1  # the caller retries the failed step: the shard answers DUPLICATE if it applied it


def test_an_answered_push_moves_on_to_a_new_number():
    n = PushNumbers()
    n.number()
    n.answered()
    assert not n.unanswered and n.upcoming() == 2 and n.number() == 2


def test_an_abandoned_push_gives_the_next_push_a_new_number():
    n = PushNumbers()
    n.number()
    n.abandon()  # a shard that did apply it must not answer DUPLICATE to a new gradient
    assert n.number() == 2


def test_after_a_restart_an_unanswered_push_goes_again_under_a_number_above_every_one_sent():
    n = PushNumbers()
    n.number()
    n.answered()
    n.number()  # 2, unanswered when the shard restarted: a restored shard acknowledged at most 2
    n.renumber()
    assert n.unanswered and n.number() == 3


def test_a_restart_with_no_push_unanswered_changes_no_number():
    n = PushNumbers()
    n.number()
    n.answered()
    n.renumber()
    assert n.upcoming() == 2


def test_a_taken_number_is_never_reused_and_does_not_take_over_an_unanswered_one():
    n = PushNumbers()
    n.number()
    assert n.take() == 2 and not n.unanswered
    assert n.take() == 3 and n.number() == 4


# ---------------------------------------------------------------------- the two owners make the same decisions
def dense_push(out: OutgoingPush) -> int:
    _, _, chunks = out.chunks(torch.ones(4), pb.ChunkHeader(length=4, dtype=pb.FLOAT32), pb.FLOAT32)
    return chunks[0].header.sequence


def lane_push(lane: Lane) -> int:
    return lane.number()


@pytest.mark.parametrize("kind", ["dense", "table"])
def test_a_dense_slice_and_a_table_lane_number_a_retry_an_answer_and_an_abandon_alike(kind):
    if kind == "dense":
        out = OutgoingPush(chunk_bytes=1 << 20)
        push, numbers, answered, abandon = (lambda: dense_push(out)), out.numbers, out.answered, out.abandon
    else:
        book = RowLanes({"emb": "sync"}, 1, Counter(), threading.Lock())
        lane = book.lanes[(0, "emb")]
        push, numbers, abandon = (lambda: lane_push(lane)), lane, lane.abandon
        answered = lambda: book.answered(lane, "emb", "accepted", base=0, version=0, attempts=1)  # noqa: E731
    sent = [push(), push()]  # the reply to the first was lost
    answered()
    sent.append(push())
    abandon()
    sent.append(push())
    assert sent == [1, 1, 2, 3] and numbers.unanswered


def test_after_a_restart_a_table_lane_abandons_its_unanswered_number_and_drops_the_kept_push():
    counters = Counter()
    book = RowLanes({"emb": "sync"}, 2, counters, threading.Lock())
    lane = book.lanes[(1, "emb")]
    lane.number()
    book.pending["emb"] = Pending({0: (), 1: ()}, done=[0])
    book.resync(1, {"emb": 3})
    assert (lane.unanswered, lane.upcoming(), lane.version, lane.wait_for) == (False, 2, 3, 3)
    assert book.pending["emb"].done == [0, 1] and counters["pushes_lost"] == 1


def test_after_a_restart_a_dense_push_goes_again_under_a_new_number():
    out = OutgoingPush(chunk_bytes=1 << 20)
    assert dense_push(out) == 1
    assert out.after_restart()
    assert dense_push(out) == 2 and out.numbers.unanswered


def test_a_stale_refusal_answers_a_table_push_and_its_lane_goes_on_from_the_shards_version():
    book = RowLanes({"emb": "stale-timeout"}, 1, Counter(), threading.Lock())
    lane = book.lanes[(0, "emb")]
    lane.number()
    book.stale(lane, version=9)
    assert (lane.unanswered, lane.version, lane.base, lane.wait_for, lane.upcoming()) == (False, 9, 9, 9, 2)
