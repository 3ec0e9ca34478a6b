"""A sync trainer compares the membership epoch each shard names for the round it sent (issue 35 item 3): shards
whose timelines split -- a joiner lost between its confirms -- are reported as an error once, and counted every
time; parts whose newest weights are of another round, or named no epoch, are not compared."""

import logging
from collections import Counter
from types import SimpleNamespace

from psserver.protocol.epochs import Epoch
from trainer.membership.session import Membership


class _Part:
    def __init__(self, name, epoch, round_, members):
        self.name = name
        self.calls = SimpleNamespace(epoch_seen=epoch, epoch_round=round_)  # (trainer.channels.call_retry.RetriedCalls)
        self.asked = 0
        self._epochs = [Epoch(0, 0, frozenset({0})).to_proto(), Epoch(epoch, 5, frozenset(members)).to_proto()]

    def stats(self, members_from_round=0):
        self.asked += 1
        return SimpleNamespace(epochs=self._epochs)


class _Client:
    def __init__(self, parts):
        self.parts, self.counters = parts, Counter()

    def count(self, name, n=1):
        self.counters[name] += n


def test_shards_naming_different_epochs_for_one_round_are_logged_once_with_both_timelines_and_counted(caplog):
    parts = [_Part("shard 0", 2, 7, {0, 1}), _Part("shard 1", 1, 7, {0})]
    client = _Client(parts)
    m = Membership(client, 1, sync=True)
    with caplog.at_level(logging.ERROR, logger="trainer.membership.session"):
        assert m.check_agreement(7) is False
        assert m.check_agreement(7) is False
    assert client.counters["membership_mismatches"] == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, errors  # each shard's timeline, then the summary: once
    assert "shard 0 names epoch 2" in errors[0] and "[0, 1]" in errors[0]
    assert "shard 1 names epoch 1" in errors[1]
    assert "shard 0 2, shard 1 1" in errors[2]
    assert [p.asked for p in parts] == [1, 1]


def test_parts_of_another_round_or_without_an_epoch_are_not_compared():
    client = _Client([_Part("shard 0", 2, 7, {0, 1}), _Part("shard 1", 1, 6, {0}), _Part("shard 2", 0, 7, {0})])
    assert Membership(client, 1, sync=True).check_agreement(7) is True
    assert client.counters["membership_mismatches"] == 0
