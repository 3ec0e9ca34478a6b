"""A StatsReply's membership timeline is bounded (psserver.protocol.epochs.timeline_to_proto, docs/limits.md):
every epoch's round and size, member lists from the round asked for and within MEMBER_LISTS_BYTES."""

from psserver.protocol.epochs import EPOCH_ENTRY_BYTES, MAX_EPOCHS, MEMBER_LISTS_BYTES, Epoch, timeline_to_proto
from psserver.protocol.limits import MAX_TRAINERS
from psserver.protocol.proto import ps_pb2 as pb


def test_lists_start_at_the_epoch_in_effect_at_the_round_asked_and_a_reply_without_one_reads_back_unlisted():
    timeline = [Epoch(0, 0, frozenset({0, 1})), Epoch(1, 4, frozenset({0, 1, 2})), Epoch(2, 9, frozenset({0, 2}))]
    sent = timeline_to_proto(timeline, members_from_round=5)
    assert [(e.round, e.size, list(e.members)) for e in sent] == [(0, 2, []), (4, 3, [0, 1, 2]), (9, 2, [0, 2])]
    back = [Epoch.from_proto(e) for e in sent]
    assert [e.listed for e in back] == [False, True, True] and back[1:] == timeline[1:]


def test_a_list_past_the_byte_budget_is_left_out_with_every_later_one_but_the_first_asked_is_always_sent():
    big = frozenset(range(1000))
    timeline = [Epoch(k, k, big) for k in range(4)]
    sent = timeline_to_proto(timeline, members_from_round=1, budget=10)
    assert [len(e.members) for e in sent] == [0, 1000, 0, 0] and all(e.size == 1000 for e in sent)


def test_a_full_timeline_of_the_largest_epochs_fits_the_documented_reply_bound():
    """MAX_EPOCHS epochs of MAX_TRAINERS members would be ~40 MB sent whole; the reply stays within
    MAX_EPOCHS x EPOCH_ENTRY_BYTES + MEMBER_LISTS_BYTES, and the epoch asked for is always listed."""
    everyone = frozenset(range(MAX_TRAINERS))
    full = [Epoch(k, 3 * k, everyone) for k in range(MAX_EPOCHS)]
    sent = pb.StatsReply(epochs=timeline_to_proto(full, members_from_round=3 * 100 + 1))
    listed = [k for k, e in enumerate(sent.epochs) if e.members]
    assert listed[0] == 100 and listed == list(range(100, 100 + len(listed)))  # contiguous, from the round asked
    assert all(e.size == MAX_TRAINERS for e in sent.epochs) and len(sent.epochs) == MAX_EPOCHS
    bound = MAX_EPOCHS * EPOCH_ENTRY_BYTES + MEMBER_LISTS_BYTES
    assert sent.ByteSize() <= bound, (sent.ByteSize(), bound)


def test_a_shards_getstats_epochs_are_built_once_per_timeline_and_anew_after_any_change():
    from collections import Counter

    from psserver.members.enrolment import Enrolment
    from psserver.protocol.job import JobSpec

    enrolment = Enrolment(0, 0, "shard 0", clock=lambda: 0.0, lease_timeout=5.0, counters=Counter(),
                          changed=lambda: None)
    enrolment.start(JobSpec(mode="sync", total_params=4, num_trainers=2, num_shards=1, fingerprint="f", max_trainers=4))
    first = enrolment.timeline_proto(0)
    assert enrolment.timeline_proto(0) is first  # the same timeline: not built again
    enrolment.epochs.leave(1, at=3)
    after = enrolment.timeline_proto(0)
    assert after is not first
    assert [(e.round, e.size) for e in after] == [(0, 2), (3, 1)]
    assert [list(e.members) for e in after] == [[0, 1], [0]]
    assert [(e.round, e.size) for e in enrolment.timeline_proto(3)] == [(0, 2), (3, 1)]
    assert [list(e.members) for e in enrolment.timeline_proto(3)] == [[], [0]]
