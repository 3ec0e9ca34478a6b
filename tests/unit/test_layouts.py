"""Layout epochs, pure (psserver.protocol.layouts): the moves of a re-shard cover every element once, the routing
rule gives every base exactly one layout, and new_job is the one re-shard on restore uses."""

import dataclasses
import itertools

import grpc
import pytest

from psserver.protocol import layouts
from psserver.protocol.errors import LayoutAhead, LayoutMoved
from psserver.protocol.layout import PARTITION_ALIGN, Layout, partition_range
from psserver.protocol.layouts import (
    LAYOUT_AHEAD,
    LAYOUT_MOVED,
    LayoutEpoch,
    LayoutError,
    first_layout,
    layout_at,
    new_job,
    next_layout,
    plan_moves,
    route_pull,
    route_push,
)
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rules import refused_layout_ahead, refused_layout_moved
import psserver.resharding.reshard
from tests.conftest import make_spec


def real_job(num_shards=1, **kw):
    """make_spec's job with the fingerprint its tensors give (new_job recomputes it, so checks it first)."""
    job = make_spec(num_shards=num_shards, **kw)
    return dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, num_shards).fingerprint())

SHAPES = [(s, k) for s in (1, 2, 3, 4) for k in (1, 2, 3)]
TOTALS = (7, 1000, 10 * PARTITION_ALIGN + 13)


def owner(total: int, layout: LayoutEpoch, x: int) -> tuple[int, int]:
    """(shard, partition) holding element ``x`` in ``layout``, found by brute force."""
    for shard in range(layout.num_shards):
        for k in range(layout.partitions):
            a, b = partition_range(total, layout.num_shards, layout.partitions, shard, k)
            if a <= x < b:
                return shard, k
    raise AssertionError(f"element {x} has no owner")


@pytest.mark.parametrize("total", TOTALS)
def test_plan_moves_covers_every_element_exactly_once_from_its_old_owner_to_its_new_one(total):
    for (m, k), (m2, k2) in itertools.product(SHAPES, SHAPES):
        old, new = LayoutEpoch(0, 0, m, k), LayoutEpoch(1, 5, m2, k2)
        moves = plan_moves(total, old, new)
        covered = [0] * total
        for mv in moves:
            assert mv.a < mv.b, f"an empty move {mv} for {m}x{k} -> {m2}x{k2}"
            for x in range(mv.a, mv.b):
                covered[x] += 1
            assert owner(total, old, mv.a) == (mv.src, mv.src_part) == owner(total, old, mv.b - 1)
            assert owner(total, new, mv.a) == (mv.dst, mv.dst_part) == owner(total, new, mv.b - 1)
        assert covered == [1] * total, f"{m}x{k} -> {m2}x{k2} over {total} elements"
        assert sum(mv.elements for mv in moves) == total


def test_a_range_whose_owner_does_not_change_is_a_local_copy_and_every_other_move_crosses_processes():
    for (m, k), (m2, k2) in itertools.product(SHAPES, SHAPES):
        for mv in plan_moves(1000, LayoutEpoch(0, 0, m, k), LayoutEpoch(1, 5, m2, k2)):
            assert mv.local == (mv.src == mv.dst), (m, k, m2, k2, mv)


def test_the_same_layout_moves_nothing_across_processes():
    for m, k in SHAPES:
        moves = plan_moves(1000, LayoutEpoch(0, 0, m, k), LayoutEpoch(1, 5, m, k))
        assert all(mv.local and (mv.src, mv.src_part) == (mv.dst, mv.dst_part) for mv in moves)


def test_moves_between_named_processes_are_local_where_the_address_is_the_same_whatever_its_index():
    """A drain renumbers: process C is shard 2 of three, then shard 1 of two.  Its range stays local."""
    old = LayoutEpoch(0, 0, 3, 1, ("a", "b", "c"))
    new = LayoutEpoch(1, 5, 2, 1, ("a", "c"))
    moves = plan_moves(1200, old, new)
    assert [(m.src, m.dst, m.a, m.b, m.local) for m in moves] == [
        (0, 0, 0, 400, True), (1, 0, 400, 600, False), (1, 1, 600, 800, False), (2, 1, 800, 1200, True)]


def test_growing_two_shards_to_three_moves_half_of_the_vector():
    """The design's ResNet-18 sketch: 2 -> 3 keeps [0, P/3) and [P/2, 2P/3) in place and moves the rest."""
    moved = sum(m.elements for m in plan_moves(6000, LayoutEpoch(0, 0, 2), LayoutEpoch(1, 5, 3)) if not m.local)
    assert moved == 3000


TIMELINE = [LayoutEpoch(0, 0, 2), LayoutEpoch(1, 10, 3, table_rounds=(("emb", 12),)), LayoutEpoch(2, 20, 2)]


def test_layout_at_names_the_layout_in_effect_at_each_round_dense_and_per_table():
    assert [layout_at(TIMELINE, r).number for r in (0, 9, 10, 19, 20, 99)] == [0, 0, 1, 1, 2, 2]
    assert [layout_at(TIMELINE, r, "emb").number for r in (10, 11, 12, 19, 20)] == [0, 0, 1, 1, 2]


def test_every_base_is_pushed_in_exactly_one_layout_and_refused_as_moved_in_the_others():
    for table in ("", "emb", "other"):
        for base in range(30):
            answers = {e.number: route_push(TIMELINE, e.number, base, table) for e in TIMELINE}
            owners = [n for n, why in answers.items() if why == ""]
            assert owners == [layout_at(TIMELINE, base, table).number], (table, base, answers)
            assert all(why == LAYOUT_MOVED for n, why in answers.items() if n not in owners)


def test_a_layout_the_timeline_does_not_hold_is_ahead_for_pushes_and_pulls():
    assert route_push(TIMELINE, 3, 25) == LAYOUT_AHEAD
    assert route_pull(TIMELINE, 7, 0) == LAYOUT_AHEAD


def test_a_pull_is_answered_by_a_layout_up_to_the_next_ones_start_inclusive():
    """Version R is the state both layouts share (the old one's last round closed it); past R only the new one."""
    assert [route_pull(TIMELINE, 0, v) for v in (0, 10, 11)] == ["", "", LAYOUT_MOVED]
    assert [route_pull(TIMELINE, 1, v) for v in (0, 10, 20, 21)] == ["", "", "", LAYOUT_MOVED]
    assert route_pull(TIMELINE, 2, 10**9) == ""
    assert route_pull(TIMELINE, 0, 11, "emb") == "" and route_pull(TIMELINE, 0, 13, "emb") == LAYOUT_MOVED


def test_epoch_zero_alone_owns_every_base_so_a_job_without_re_shard_is_unchanged():
    timeline = [first_layout(make_spec(num_shards=2))]
    assert all(route_push(timeline, 0, b) == "" and route_pull(timeline, 0, b) == "" for b in range(0, 10**6, 997))


def test_a_layout_epoch_survives_the_wire():
    e = LayoutEpoch(3, 40, 4, 2, ("h:1", "h:2", "h:3", "h:4"), "ab" * 8, (("a", 41), ("b", 42)))
    assert LayoutEpoch.from_proto(pb.LayoutEpoch.FromString(e.to_proto().SerializeToString())) == e
    assert LayoutEpoch.from_proto(pb.LayoutEpoch()) == LayoutEpoch(0, 0, 0, 1)


def test_the_next_layout_starts_after_the_newest_and_carries_the_new_jobs_fingerprint():
    job = real_job()
    timeline = [first_layout(job)]
    moved = new_job(job, 2)
    nxt = next_layout(timeline, moved, 7)
    assert (nxt.number, nxt.round, nxt.num_shards, nxt.fingerprint) == (1, 7, 2, moved.fingerprint)
    assert nxt.fingerprint != job.fingerprint
    with pytest.raises(LayoutError, match="round is 0 but layout 0 starts at round 0"):
        next_layout(timeline, moved, 0)


def test_new_job_is_the_one_re_shard_on_restore_uses():
    assert psserver.resharding.reshard.new_job is layouts.new_job
    job = real_job(num_shards=2)
    got = new_job(job, 3, 2)
    assert (got.num_shards, got.partitions, got.fingerprint) == (3, 2, real_job(num_shards=3).fingerprint)
    assert issubclass(psserver.resharding.reshard.ReshardError, LayoutError)  # restore's refusals are layout refusals too
    with pytest.raises(LayoutError, match="fingerprint ffffffffffffffff is not the one its tensors give"):
        new_job(make_spec(), 2)


class _Refusal(grpc.RpcError):
    def __init__(self, e):
        self._e = e

    def code(self):
        return self._e.code

    def trailing_metadata(self):
        return self._e.trailers()


def test_the_trainer_reads_a_layout_moved_refusals_newest_layout_from_its_trailer():
    moved = _Refusal(LayoutMoved("layout_epoch is 0 ...", newest=4))
    assert moved.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused_layout_moved(moved) == 4 and not refused_layout_ahead(moved)
    ahead = _Refusal(LayoutAhead("layout_epoch is 9 ..."))
    assert ahead.code() == grpc.StatusCode.OUT_OF_RANGE
    assert refused_layout_ahead(ahead) and refused_layout_moved(ahead) is None


def test_a_refusal_names_the_layout_sent_the_newest_the_base_and_the_round_between_them():
    past = layouts.refusal(TIMELINE, 0, 12)
    assert isinstance(past, LayoutMoved) and past.newest == 2
    assert "layout_epoch is 0 but this shard's newest layout is 2, and base version 12 is at or after round 10, " \
           "where layout 0 ends" in str(past)
    early = layouts.refusal(TIMELINE, 2, 15)
    assert "layout_epoch is 2" in str(early)
    assert "base version 15 is before round 20, where layout 2 starts" in str(early)
    pulled = layouts.refusal(TIMELINE, 1, 21, pull=True)
    assert "version 21 is past round 20, where layout 1 ends" in str(pulled)
    table = layouts.refusal(TIMELINE, 0, 12, table="emb")
    assert "base version 12 is at or after table 'emb''s round 12" in str(table)
    ahead = layouts.refusal(TIMELINE, 9, 0)
    assert isinstance(ahead, LayoutAhead) and "layout_epoch is 9 but this shard knows layouts 0 to 2" in str(ahead)
    assert layouts.refusal(TIMELINE, 1, 15) is None and layouts.refusal(TIMELINE, 0, 10, pull=True) is None
