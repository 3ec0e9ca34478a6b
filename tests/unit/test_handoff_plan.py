"""A live re-shard's plan as a shard and the coordinator hold it (no network): the plan id a re-run of
`ps-server reshard` names again, each shard's place in both lists, and the moves it is a source of."""

import dataclasses

from psserver.handoff_io import Plan
from psserver.protocol.layout import Layout, shard_range
from psserver.reshard_cmd import plan_id
from tests.conftest import P, make_spec

OLD, NEW = ("a:1", "b:2"), ("a:1", "b:2", "c:3")


def test_plan_id_is_the_same_for_a_rerun_and_differs_for_another_list_or_partitions():
    assert plan_id(list(OLD), list(NEW), 0) == plan_id(list(OLD), list(NEW), 0)
    assert plan_id(list(OLD), list(NEW), 0) != plan_id(list(OLD), list(NEW[:2]) + ["d:4"], 0)
    assert plan_id(list(OLD), list(NEW), 0) != plan_id(list(OLD), list(NEW), 2)


def test_a_shard_finds_its_place_in_both_lists_and_a_new_shard_only_in_the_new_one():
    assert (Plan("p", OLD, NEW, 0, "b:2").old_index, Plan("p", OLD, NEW, 0, "b:2").new_index) == (1, 1)
    assert (Plan("p", OLD, NEW, 0, "c:3").old_index, Plan("p", OLD, NEW, 0, "c:3").new_index) == (None, 2)


def test_the_moves_of_two_to_three_cover_every_element_once_and_each_old_shard_sends_two():
    job = make_spec(num_shards=2)
    job = dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 2).fingerprint())
    moves = Plan("p", OLD, NEW, 0, "a:1").moves(job)
    assert sorted((m.a, m.b) for m in moves) == [(0, 333), (333, 500), (500, 666), (666, P)]
    assert [m.src for m in moves].count(0) == [m.src for m in moves].count(1) == 2
    for m in moves:
        lo, hi = shard_range(P, 3, m.dst)
        assert lo <= m.a < m.b <= hi
