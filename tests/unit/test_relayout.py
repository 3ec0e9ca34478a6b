"""The trainer's layout-switch decisions (trainer.membership.relayout, trainer.stepping.attempt, trainer.channels.client): pure, no network."""

from collections import Counter
from types import SimpleNamespace

import grpc
import pytest
import torch

from psserver.protocol.errors import JobMismatch, LayoutAhead, LayoutMoved
from psserver.protocol.layout import partition_range
from psserver.protocol.layouts import LayoutEpoch
from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import make_spec
from trainer.stepping.attempt import moved_everywhere, moved_past_unreachable
from trainer.channels.client import ConnectAbandoned, RetryPolicy, ShardClient
from trainer.channels.compress import TopK
from trainer.membership.relayout import (
    LayoutNotFollowed,
    LayoutTimeline,
    RegisterMoved,
    Relayout,
    due,
    give_back_topk,
    layout_addresses,
    moved_at_register,
    recut_residuals,
    slot_ranges,
)

TIMELINE = [LayoutEpoch(0, 0, 2), LayoutEpoch(1, 5, 1, 2, ("a:1",)), LayoutEpoch(2, 9, 3)]


class _Error(grpc.RpcError):
    def __init__(self, e):
        self._e = e

    def code(self):
        return self._e.code

    def details(self):
        return str(self._e)

    def trailing_metadata(self):
        return self._e.trailers()


def test_a_step_switches_to_the_layout_that_owns_its_base_and_only_to_a_later_one():
    assert due(TIMELINE, 0, 4) is None  # base < R: still layout 0's
    assert due(TIMELINE, 0, 5).number == 1 and due(TIMELINE, 0, 9).number == 2  # one behind, or two
    assert due(TIMELINE, 1, 7) is None and due(TIMELINE, 2, 9) is None  # already there
    assert due([], 0, 100) is None  # nothing fetched: stay


@pytest.mark.parametrize("shards,partitions", [(1, 1), (1, 2), (2, 1), (3, 2)])
def test_the_new_slots_tile_the_flat_vector_in_order_as_the_shards_cut_it(shards, partitions):
    job = make_spec(num_shards=shards, partitions=partitions)
    ranges = slot_ranges(1000, job)
    assert len(ranges) == shards * partitions and ranges[0][0] == 0 and ranges[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1] == partition_range(1000, shards, partitions, shards - 1, partitions - 1)


def test_a_layout_names_its_addresses_or_keeps_the_trainers_list_only_for_the_same_shard_count():
    assert layout_addresses(TIMELINE[1], ["x:1", "y:2"]) == ["a:1"]
    assert layout_addresses(TIMELINE[0], ["x:1", "y:2"]) == ["x:1", "y:2"]
    with pytest.raises(LayoutNotFollowed, match="layout 2 has 3 shards and names no addresses, but this trainer "
                                                "knows 2 \\(x:1, y:2\\)"):
        layout_addresses(TIMELINE[2], ["x:1", "y:2"])


def test_topk_residuals_are_laid_end_to_end_and_recut_by_the_new_ranges_losing_nothing():
    old, new = [(0, 4), (4, 10)], [(0, 3), (3, 7), (7, 10)]
    residuals = [torch.arange(4.0), torch.arange(4.0, 10.0)]
    cut = recut_residuals(residuals, old, new)
    assert [c.tolist() for c in cut] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    assert recut_residuals([None, None], old, new) == [None, None, None]
    assert torch.equal(torch.cat(recut_residuals([None, torch.ones(6)], old, new)), torch.tensor([0.0] * 4 + [1.0] * 6))


def test_a_step_is_rerouted_only_when_every_failure_is_layout_moved_and_no_slot_applied_it():
    moved = {0: _Error(LayoutMoved("x", newest=1)), 1: _Error(LayoutMoved("x", newest=2))}
    assert moved_everywhere(moved, []) == 2
    assert moved_everywhere(moved, [2]) is None  # a slot applied it: a split step, raised as it is
    assert moved_everywhere({**moved, 2: _Error(JobMismatch("x"))}, []) is None
    assert moved_everywhere({0: RuntimeError("x")}, []) is None and moved_everywhere({}, []) is None


def test_a_refused_topk_push_gives_back_what_it_took_from_the_residual():
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f", Counter(), compressor=TopK(0.25))
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0, 0.25, -0.125, 3.0, 0.0])
    # compressed: the residual keeps what was not sent
    client.dense.outgoing.chunks(grad, pb.ChunkHeader(dtype=pb.FLOAT32, length=8), pb.FLOAT32)
    assert client.dense.unanswered and client.compressor.residual.abs().sum() > 0
    give_back_topk(client, grad)
    assert torch.equal(client.compressor.residual, torch.zeros(8)) and not client.dense.unanswered
    client.close()


def test_layout_ahead_is_retried_within_the_budget_and_layout_moved_is_raised_at_once_teaching_the_layout():
    client = ShardClient("127.0.0.1:1", 0, 0, "t0", "f", Counter(),
                         retry=RetryPolicy(budget_seconds=30, initial_backoff=0.001, max_backoff=0.001))
    answers = [_Error(LayoutAhead("layout_epoch is 1")), "ok"]

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    calls = client.calls
    assert calls.call("Push", call) == "ok"
    assert (calls.counters["retries"], calls.counters["layout_ahead_retries"]) == (1, 1)
    with pytest.raises(grpc.RpcError):
        calls.call("Push", lambda: (_ for _ in ()).throw(_Error(LayoutMoved("layout_epoch is 0", newest=3))))
    assert calls.layout_seen == 3 and calls.counters["retries"] == 1
    client.close()


class _Seen(SimpleNamespace):
    def saw_layout(self, number):
        self.layout_seen = max(self.layout_seen, number)


class _Part(SimpleNamespace):
    def stats(self):
        self.fetched += 1
        return pb.StatsReply(layouts=[e.to_proto() for e in TIMELINE])


def _client(seen):
    parts = [_Part(name=f"shard {i}", calls=_Seen(layout_seen=n), caller=SimpleNamespace(layout_epoch=0), fetched=0)
             for i, n in enumerate(seen)]
    counters = Counter()
    return SimpleNamespace(parts=parts, counters=counters, count=lambda k, n=1: counters.update({k: n}),
                           job=SimpleNamespace(mode="sync"))  # (an async job follows the newest layout: relayout.due)


def test_the_timeline_is_fetched_once_per_layout_a_reply_named_and_never_while_none_is_new():
    client = _client([0, 0])
    timeline = LayoutTimeline(client)
    assert timeline.learn() == [] and client.counters["layout_fetches"] == 0
    client.parts[1].calls.layout_seen = 2
    assert timeline.learn() == TIMELINE and client.parts[1].fetched == 1
    timeline.learn()
    assert client.counters["layout_fetches"] == 1  # known now: no second fetch


def test_a_trainer_running_a_variant_that_cannot_follow_refuses_the_switch_naming_it_and_changes_nothing():
    client = _client([1, 1])
    slots = SimpleNamespace(client=client, ranges=[(0, 5), (5, 10)])
    relayout = Relayout(slots, session=None, unsupported="overlap, tables")
    assert relayout.switch_if_due(4) is False  # base < R: nothing to do, whatever the variant
    with pytest.raises(LayoutNotFollowed, match="layout 1 takes over from round 5 but this trainer runs overlap, "
                                                "tables, which cannot follow"):
        relayout.switch_if_due(5)
    assert slots.ranges == [(0, 5), (5, 10)] and relayout.epoch == 0


class _Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "Stream removed (Socket closed)"

    def trailing_metadata(self):
        return ()


def test_a_step_moved_on_some_slots_and_unreachable_on_another_is_resent_whole_only_past_the_new_layouts_round():
    moved = _Error(LayoutMoved("x", newest=1))
    failed = {0: moved, 1: _Unreachable()}
    assert moved_everywhere(failed, []) is None and moved_past_unreachable(failed, []) == (1, 1)
    assert moved_past_unreachable(failed, [2]) is None  # a slot applied it: a split step, raised as it is
    assert moved_past_unreachable({**failed, 2: _Error(JobMismatch("x"))}, []) is None  # a real refusal
    assert moved_past_unreachable({1: _Unreachable()}, []) is None  # nothing moved: a plain failure
    assert moved_past_unreachable({0: moved}, []) is None  # all moved: moved_everywhere's case

    client = _client([0, 0])
    for p in client.parts:
        p.dense, p.compressor, p.slot = SimpleNamespace(outgoing=SimpleNamespace(sent=None)), None, 0
    slots = SimpleNamespace(client=client, ranges=[(0, 5), (5, 10)], slice=lambda t, i: t,
                            flat=SimpleNamespace(grad=torch.zeros(10)))
    relayout, switched = Relayout(slots, session=SimpleNamespace(rank=0)), []
    relayout.switch = lambda layout, base: switched.append((layout.number, base))
    # base 4 < R 5: the unreachable old shard may hold it -- not re-sent, nothing counted
    assert relayout.reroute(1, 4, 2, unreachable=1) is False and switched == []
    assert client.counters["pushes_rerouted"] == client.counters["steps_rerouted_past_unreachable"] == 0
    # base 5 >= R: no old shard applied it, so both slots' parts go again whole in layout 1
    assert relayout.reroute(1, 5, 2, unreachable=1) is True and switched == [(1, 5)]
    assert (client.counters["pushes_rerouted"], client.counters["steps_rerouted_past_unreachable"]) == (2, 1)


WHERE = ["shard 0 at a:1", "shard 1 at b:2"]
LAYOUT_1 = TIMELINE[1]


def _moved(layout=None):
    """A Register refused layout-moved, carrying ``layout`` whole (psserver.resharding.layout_host.register_host) or not."""
    whole = layout.to_proto().SerializeToString() if layout is not None else b""
    return _Error(LayoutMoved("layout_epoch is 0 but this shard's newest layout is 1, from round 5: register in it",
                              1, whole))


def test_a_register_refused_layout_moved_naming_a_later_layout_follows_it_whatever_waits_it_abandoned():
    assert moved_at_register([_moved(LAYOUT_1), _moved(LAYOUT_1)], 0, WHERE) == LAYOUT_1
    # a drained shard that was stopped: its wait is abandoned for the refusal the other slot got
    assert moved_at_register([ConnectAbandoned("abandoned"), _moved(LAYOUT_1)], 0, WHERE) == LAYOUT_1
    assert moved_at_register([_moved(LAYOUT_1), _moved(TIMELINE[2])], 0, WHERE) == TIMELINE[2]  # the newest


def test_a_register_that_was_not_refused_layout_moved_everywhere_else_is_left_to_the_usual_path():
    other = _Error(JobMismatch("job spec differs"))
    assert moved_at_register([pb.RegisterReply(), pb.RegisterReply()], 0, WHERE) is None  # registered
    assert moved_at_register([other, ConnectAbandoned("x")], 0, WHERE) is None  # no layout-moved
    assert moved_at_register([_moved(LAYOUT_1), pb.RegisterReply()], 0, WHERE) is None  # one slot took it
    assert moved_at_register([_moved(LAYOUT_1), other], 0, WHERE) is None  # another refusal: report that


@pytest.mark.parametrize("layout", [None, TIMELINE[0]], ids=["none-named", "not-later"])
def test_a_register_refused_layout_moved_without_a_later_layout_stays_fatal_in_one_line_naming_the_shard(layout):
    with pytest.raises(RegisterMoved) as e:
        moved_at_register([ConnectAbandoned("x"), _moved(layout)], 0, WHERE)
    message = str(e.value)
    assert "\n" not in message and message.startswith("shard 1 at b:2 refused Register layout-moved (layout_epoch")
    assert "restart it on the new layout's --ps list" in message
