"""The worker-side row cache (trainer.tables.row_cache) against a fake shard with counted versions: no network."""

import pytest
import torch

from trainer.tables.embedding import ShardedEmbeddingBag
from trainer.tables.row_cache import RowCache, pull_through

DIM = 2


class FakeShards:
    """``m`` shards of one table; a row's value is (id, version it was last written at).  ``update`` moves a
    shard's version (an applied push or a closed round) and rewrites the rows it touches."""

    def __init__(self, m: int = 2):
        self.m, self.version, self.written, self.writes = m, [0] * m, {}, {}
        self.pulled = 0

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.m

    def value(self, i: int) -> list[float]:
        return [float(i), float(self.written.get(i, 0))]

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.pulled += len(ids)
        rows = torch.tensor([self.value(i) for i in ids.tolist()]).view(len(ids), DIM)
        return rows, torch.tensor([self.version[s] for s in self.owner(ids).tolist()], dtype=torch.int64)

    def update(self, shard: int, ids=()) -> None:
        self.version[shard] += 1
        for i in ids:
            if i % self.m == shard:
                self.written[i] = self.version[shard]
                self.writes.setdefault(i, []).append(self.version[shard])

    def known(self) -> torch.Tensor:
        return torch.tensor(self.version)

    def pull(self, cache: RowCache, ids) -> torch.Tensor:
        ids = torch.tensor(sorted(set(ids)), dtype=torch.int64)
        return pull_through(cache, ids, self.owner(ids), self.known(), self.fetch)[0]

    def exact(self, ids) -> torch.Tensor:
        return torch.tensor([self.value(i) for i in sorted(set(ids))]).view(-1, DIM)


def test_bound_zero_serves_exactly_what_a_pull_reads_and_hits_only_while_the_table_stands_still():
    shards, cache = FakeShards(), RowCache(64, DIM, max_staleness=0)
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        ids = torch.randint(0, 30, (12,), generator=gen).tolist()
        assert torch.equal(shards.pull(cache, ids), shards.exact(ids))
        assert torch.equal(shards.pull(cache, ids), shards.exact(ids))  # a second forward at the same version
        if step % 3:  # some steps move one shard only: the other's rows stay servable
            shards.update(step % 2, ids)
    assert cache.counts["hits"] > 0 and cache.counts["stale"] > 0


@pytest.mark.parametrize("bound", [1, 4])
def test_a_bound_of_s_never_serves_a_row_more_than_s_versions_old(bound):
    shards, cache = FakeShards(), RowCache(64, DIM, max_staleness=bound)
    gen = torch.Generator().manual_seed(bound)
    for step in range(200):
        ids = torch.randint(0, 20, (8,), generator=gen).tolist()
        rows = shards.pull(cache, ids)
        uniq = sorted(set(ids))
        for i, row in zip(uniq, rows.tolist()):
            # the value served was the shard's at some version >= known - bound: no write it misses is older
            missed = [w for w in shards.writes.get(i, []) if w > row[1]]
            assert not missed or missed[0] > shards.version[i % shards.m] - bound
        for s in range(shards.m):
            shards.update(s, [i for i in uniq if int(torch.randint(0, 2, (1,), generator=gen))])
    assert cache.counts["hits"] > 0 and cache.counts["stale"] > 0


def test_a_bound_of_s_serves_a_row_read_s_versions_ago_and_pulls_it_again_one_version_later():
    shards, cache = FakeShards(m=1), RowCache(8, DIM, max_staleness=2)
    shards.pull(cache, [5])
    for _ in range(2):
        shards.update(0, [5])
        assert shards.pull(cache, [5])[0, 1] == 0  # the copy read at version 0, served at 1 and 2
    shards.update(0, [5])
    assert shards.pull(cache, [5])[0, 1] == 3  # 3 versions old: pulled again
    assert (cache.counts["hits"], cache.counts["stale"], cache.counts["misses"]) == (2, 1, 1)


def test_the_cache_never_holds_more_than_cache_rows_and_evicts_the_least_recently_used():
    shards, cache = FakeShards(), RowCache(10, DIM, max_staleness=100)
    shards.pull(cache, range(8))
    shards.pull(cache, [0, 1])  # used again: kept over 2..7
    for start in range(100, 400, 7):
        shards.pull(cache, range(start, start + 5))
        assert len(cache) <= 10
        assert torch.equal(cache.keys, torch.sort(cache.keys).values)
        assert len(set(cache.slots.tolist())) == len(cache.slots)
    assert cache.rows.shape == (10, DIM)  # allocated once
    big = RowCache(4, DIM, max_staleness=100)
    shards.pull(big, range(1000, 1050))  # one pull bigger than the cache
    assert len(big) == 4 and big.counts["misses"] == 50
    lru = RowCache(4, DIM, max_staleness=100)
    for i in (2, 3, 4, 1):
        shards.pull(lru, [i])
    shards.pull(lru, [9])  # evicts 2, the least recently used
    assert sorted(lru.keys.tolist()) == [1, 3, 4, 9]


def test_a_cached_row_answers_its_own_value_after_evictions_and_refreshes():
    shards, cache = FakeShards(), RowCache(6, DIM, max_staleness=1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(100):
        ids = torch.randint(0, 15, (5,), generator=gen).tolist()
        rows = shards.pull(cache, ids)
        assert rows[:, 0].tolist() == [float(i) for i in sorted(set(ids))]  # every row is its own id's


def test_bound_zero_drops_a_pushed_rows_copy_at_once():
    shards, cache = FakeShards(m=1), RowCache(8, DIM, max_staleness=0)
    shards.pull(cache, [1, 2, 3])
    cache.pushed(torch.tensor([1, 2]))
    assert sorted(cache.keys.tolist()) == [3]
    assert cache.counts["dropped"] == 2


def test_a_pushed_row_ages_by_the_version_its_push_moved_and_is_pulled_again_past_the_bound():
    shards, cache = FakeShards(m=1), RowCache(8, DIM, max_staleness=1)
    shards.pull(cache, [1])
    cache.pushed(torch.tensor([1]))
    shards.update(0, [1])  # our push applied: version 1
    assert shards.pull(cache, [1])[0, 1] == 0 and cache.counts["hits"] == 1  # one version old: within 1
    cache.pushed(torch.tensor([1]))
    shards.update(0, [1])
    assert shards.pull(cache, [1])[0, 1] == 2 and cache.counts["stale"] == 1  # two old: pulled again


def test_a_row_read_at_a_version_the_shard_went_back_from_is_not_served():
    cache = RowCache(8, DIM, max_staleness=3)
    cache.insert(torch.tensor([4]), torch.ones(1, DIM), torch.tensor([7]), torch.tensor([0]))
    look = cache.lookup(torch.tensor([4]), known=torch.tensor([5]))  # restored to version 5
    assert not bool(look.hit[0]) and bool(look.stale[0])
    cache.drop_shard(0)
    assert len(cache) == 0


def test_cache_sizes_are_refused_when_negative_or_past_the_tables_push_bound():
    with pytest.raises(ValueError, match=r"cache_rows \(0\) must be at least 1"):
        RowCache(0, DIM)
    with pytest.raises(ValueError, match=r"cache_staleness \(-1\)"):
        ShardedEmbeddingBag("t", 4, cache_rows=10, cache_staleness=-1)
    with pytest.raises(ValueError, match=r"cache_staleness \(3\) is above max_staleness \(2\)"):
        ShardedEmbeddingBag("t", 4, table_mode="async", max_staleness=2, cache_rows=10, cache_staleness=3)


def test_the_index_answers_hits_and_misses_and_a_dropped_or_evicted_id_misses_again():
    cache = RowCache(8, DIM, max_staleness=5)
    ids = torch.tensor([10, 20, 30])
    zeros = torch.zeros(3, dtype=torch.int64)
    cache.insert(ids, torch.arange(6.0).view(3, DIM), zeros, zeros)
    look = cache.lookup(torch.tensor([30, 11, 10]), known=torch.tensor([0]))
    assert look.hit.tolist() == [True, False, True] and look.rows.tolist() == [[4.0, 5.0], [0.0, 1.0]]
    cache.drop(torch.tensor([30, 99]))
    assert cache.lookup(torch.tensor([30, 20]), known=torch.tensor([0])).hit.tolist() == [False, True]
    assert cache.counts["dropped"] == 1 and len(cache) == 2


def test_at_capacity_an_insert_evicts_least_recently_used_rows_never_one_it_refreshes():
    cache = RowCache(128, DIM, max_staleness=100)
    zeros = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731
    cache.insert(torch.arange(128), torch.zeros(128, DIM), zeros(128), zeros(128))
    cache.lookup(torch.arange(64, 128), known=torch.tensor([0]))  # 64..127 used again: 0..63 least recent
    # 4 ids held (refreshed) and 10 new: 10 slots or more freed from 0..63, never from the refreshed 0..3
    cache.insert(torch.cat([torch.arange(4), torch.arange(1000, 1010)]), torch.ones(14, DIM), zeros(14), zeros(14))
    held = set(cache.keys.tolist())
    assert set(range(1000, 1010)) <= held and set(range(4)) <= held and set(range(64, 128)) <= held
    assert len(cache) <= 128 and cache.counts["evicted"] == 128 + 10 - len(cache)
    assert len(set(cache.slots.tolist())) == len(cache)  # one slot per id held


def test_memory_stays_within_its_bound_and_flat_through_a_long_stream_of_new_ids():
    capacity, dim = 1000, 16
    cache = RowCache(capacity, dim, max_staleness=2)
    gen = torch.Generator().manual_seed(0)
    bound = capacity * (dim * 4 + 5 * 8) + 8 * 21 * capacity + 64 * 21  # slots, free stack, index (<= 8 positions)
    sizes = []
    for step in range(300):
        ids = torch.unique(torch.randint(0, 10**9, (400,), generator=gen))
        look = cache.lookup(ids, known=torch.tensor([step]))
        miss = ids[~look.hit]
        n = len(miss)
        cache.insert(miss, torch.zeros(n, dim), torch.full((n,), step), torch.zeros(n, dtype=torch.int64))
        if step % 4 == 3:
            cache.pushed(ids)
            cache.drop(ids[: len(ids) // 2])
        assert len(cache) <= capacity
        sizes.append(cache.nbytes())
    assert max(sizes) <= bound
    assert len(set(sizes[150:])) <= 3  # the index settles at a size or two: memory does not creep
