"""trainer.tables.row_prefetch without a network: when an announced batch's rows are pulled, used, adopted and dropped."""

from __future__ import annotations

from collections import Counter

import torch

from tests.helpers import wait_until
from trainer.tables.lookahead import look_ahead, probe_ids
from trainer.tables.embedding import ShardedEmbedding, ShardedEmbeddingBag
from trainer.tables.row_prefetch import RowPrefetch

DIM = 2


class FakeShards:
    """Two shards: even ids on 0, odd on 1; a row is its id repeated; versions as set by the test."""

    def __init__(self, fail=()):
        self.fetched, self.adopted, self.counts, self.fail = [], [], Counter(), set(fail)
        self.version = 5

    def split(self, ids):
        return [(ids % 2 == s).nonzero().flatten() for s in range(2)]

    def fetch(self, shard, table, ids):
        self.fetched.append((shard, table, ids.tolist()))
        if shard in self.fail:
            raise ConnectionError(f"shard {shard} is down")
        return ids.float().unsqueeze(1).repeat(1, DIM), self.version

    def adopt(self, shard, table, version):
        self.adopted.append((shard, table, version))

    def count(self, **n):
        self.counts.update(n)


def prefetch(shards: FakeShards, sync: bool) -> RowPrefetch:
    return RowPrefetch({"t": DIM}, {"t": sync}, 2, shards.split, shards.fetch, shards.adopt, shards.count)


def test_a_sync_tables_next_batch_is_pulled_only_after_this_steps_push_and_then_used():
    shards = FakeShards()
    ahead = prefetch(shards, sync=True)
    ahead.announce("t", torch.tensor([4, 3, 4]), ahead=1)
    assert shards.fetched == []  # its rows must be those of the version this step's push leads to
    assert ahead.take("t", torch.tensor([3, 4])) is None  # not this step's batch
    ahead.pushed("t")
    rows, known = ahead.take("t", torch.tensor([3, 4, 9]))
    assert sorted(shards.fetched) == [(0, "t", [4]), (1, "t", [3])]
    assert known.tolist() == [True, True, False]
    assert torch.equal(rows[:2], torch.tensor([[3.0, 3.0], [4.0, 4.0]]))
    assert sorted(shards.adopted) == [(0, "t", 5), (1, "t", 5)]  # used: their versions are the push's base
    assert shards.counts["prefetch_hits"] == 2 and shards.counts["prefetch_misses"] == 1
    ahead.close()


def test_an_async_tables_batch_is_pulled_at_once_and_forgotten_after_its_own_steps_push():
    shards = FakeShards()
    ahead = prefetch(shards, sync=False)
    ahead.announce("t", torch.tensor([2]), ahead=0)
    ahead.announce("t", torch.tensor([7]), ahead=1)
    rows, known = ahead.take("t", torch.tensor([2]))
    assert known.tolist() == [True]
    # the second batch's pull started at its announcement, in the background: wait for it, do not race it
    wait_until(lambda: sorted(s for s, _, _ in shards.fetched) == [0, 1], "the second batch's pull to start")
    ahead.pushed("t")  # the first batch's step is done: the second one is now the current one
    rows, known = ahead.take("t", torch.tensor([2, 7]))
    assert known.tolist() == [False, True]
    ahead.pushed("t")
    assert ahead.take("t", torch.tensor([7])) is None
    ahead.close()


def test_an_unused_shard_is_not_adopted_and_a_failed_pull_is_counted_and_left_to_the_forward():
    shards = FakeShards(fail={1})
    ahead = prefetch(shards, sync=False)
    ahead.announce("t", torch.tensor([2, 3]), ahead=0)
    rows, known = ahead.take("t", torch.tensor([2, 3]))
    assert known.tolist() == [True, False]
    assert shards.adopted == [(0, "t", 5)]
    assert shards.counts["prefetch_failed"] == 1


def test_drop_forgets_every_announced_batch():
    shards = FakeShards()
    ahead = prefetch(shards, sync=False)
    ahead.announce("t", torch.tensor([2]), ahead=0)
    ahead.drop()
    assert ahead.take("t", torch.tensor([2])) is None and shards.counts["prefetch_dropped"] == 1


def test_look_ahead_announces_each_batch_one_yield_early_and_the_first_as_current():
    seen = []
    batches = look_ahead([10, 20, 30], lambda ids, ahead: seen.append((ids, ahead)), lambda b: b)
    assert next(batches) == 10 and seen == [(10, 0), (20, 1)]
    assert next(batches) == 20 and seen[-1] == (30, 1)
    assert list(batches) == [30] and len(seen) == 3


def test_probing_a_forward_finds_every_tables_ids_without_a_backend_or_gradient():
    model = torch.nn.Module()
    model.a = ShardedEmbedding("a", DIM)
    model.b = ShardedEmbeddingBag("b", DIM, mode="sum")
    ids = probe_ids(model, (torch.tensor([5, 1, 5]), torch.tensor([[9, 9], [2, 3]])),
                    forward=lambda m, batch: m.a(batch[0]).sum() + m.b(batch[1]).sum())
    assert {k: v.tolist() for k, v in ids.items()} == {"a": [1, 5], "b": [2, 3, 9]}
    assert model.a._probe is None and model.a._pending == []  # back to normal, nothing kept
