"""A trainer's view of the membership timeline (trainer.membership.session.Membership) when GetStats lists members only
from the round asked for: it asks from the round it computes, splits data by every epoch's size, and asks
again only for an epoch it has no list of."""

from collections import Counter
from types import SimpleNamespace

from psserver.protocol.epochs import Epoch, timeline_to_proto
from psserver.protocol.proto import ps_pb2 as pb
from trainer.membership.session import Membership

TIMELINE = [Epoch(0, 0, frozenset({0, 1})), Epoch(1, 4, frozenset({0, 1, 2})), Epoch(2, 9, frozenset({0, 2}))]


class FakePart:
    """One slot of the trainer's client: the shard answers GetStats from TIMELINE within ``budget`` bytes."""

    def __init__(self, budget: int):
        self.calls = SimpleNamespace(epoch_seen=0, epoch_round=-1)  # (trainer.channels.call_retry.RetriedCalls)
        self.budget, self.asked = budget, []

    def stats(self, members_from_round: int = 0) -> pb.StatsReply:
        self.asked.append(members_from_round)
        return pb.StatsReply(epochs=timeline_to_proto(TIMELINE, members_from_round, self.budget))


class FakeClient:
    def __init__(self, budget: int = 1 << 16):
        self.parts, self.counters = [FakePart(budget)], Counter()

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n


def test_members_are_asked_from_the_round_computed_and_every_epochs_size_comes_with_them():
    client = FakeClient()
    client.parts[0].calls.epoch_seen = 1
    m = Membership(client, num_trainers=2)
    assert m.members_at(5) == [0, 1, 2] and client.parts[0].asked == [5]
    assert [(e.round, e.size) for e in m.timeline] == [(0, 2), (4, 3), (9, 2)]  # what round_batch splits by
    assert not m.timeline[0].listed  # a past epoch's list was not sent, nor needed
    assert m.members_at(6) == [0, 1, 2] and client.counters["timeline_fetches"] == 1  # known: no second fetch


def test_an_epoch_whose_list_the_reply_left_out_is_asked_for_again_from_its_round():
    client = FakeClient(budget=1)  # room for one list a reply
    client.parts[0].calls.epoch_seen = 2
    m = Membership(client, num_trainers=2)
    assert m.members_at(5) == [0, 1, 2]
    assert not m.timeline[2].listed
    assert m.members_at(9) == [0, 2] and client.parts[0].asked == [5, 9]
