"""The worker-side row cache over real shards on loopback: with bound 0 a sync job of 2 trainers x 2 shards ends
with exactly the rows of the same job without a cache (with and without prefetch, a cache small enough to evict);
an async job with bound 4 trains, serves hits and reports hits, misses and stale re-pulls in its counters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.protocol.rows.optim import SparseOptimizerConfig
from tests.helpers import run_ranks
from trainer.stepping.api import connect
from trainer.tables.embedding import ShardedEmbedding, ShardedEmbeddingBag

STEPS, B, N = 6, 6, 40


class Rec(nn.Module):
    def __init__(self, cache_rows: int, staleness: int, table_mode: str = ""):
        super().__init__()
        kw = {"cache_rows": cache_rows, "cache_staleness": staleness}
        self.user = ShardedEmbedding("user", 3, num_embeddings=N, seed=1, mode=table_mode,
                                     optimizer=SparseOptimizerConfig("sgd", lr=0.05), **kw)
        self.item = ShardedEmbeddingBag("item", 3, mode="sum", seed=2, table_mode=table_mode,
                                        optimizer=SparseOptimizerConfig("adagrad", lr=0.05), **kw)
        self.out = nn.Linear(3, 1)

    def forward(self, users, items):
        return self.out(self.user(users) * self.item(items)).squeeze(-1)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, N, (B,), generator=g), torch.randint(0, N, (B, 3), generator=g), torch.randn(B, generator=g)


def train(ps, model: Rec, rank: int, prefetch: bool) -> torch.Tensor:
    batches = [batch(rank, k) for k in range(STEPS)]
    if prefetch:
        batches = ps.prefetching(batches, forward=lambda m, b: m(*b[:2]))
    for users, items, y in batches:
        loss = (model(users, items) - y).pow(2).mean()
        loss.backward()
        with torch.no_grad():  # an evaluation forward at the same version: served from the cache
            model(users, items)
        ps.step(num_samples=B)
        ps.zero_grad()
    return loss.detach()


def sync_job(shard_server, cache_rows: int, prefetch: bool = False) -> dict:
    shards = [shard_server(shard=i) for i in range(2)]
    addresses = ",".join(s.server.address for s in shards)
    out, models = {}, []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Rec(cache_rows, 0))

    def one(rank):
        with connect(addresses, models[rank], mode="sync", rank=rank, num_trainers=2,
                     optimizer={"name": "sgd", "lr": 0.1}) as ps:
            train(ps, models[rank], rank, prefetch)
            if rank == 0:
                out["rows"] = {n: ps.rows.pull(n, torch.arange(N)) for n in ("user", "item")}
                out["dense"] = {k: v.clone() for k, v in models[rank].state_dict().items()}
            out[f"counters{rank}"] = ps.counters

    run_ranks(one, 2, timeout=120)
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_sync_trainers_with_a_cache_of_bound_zero_end_with_the_same_rows_as_without(shard_server, prefetch):
    plain = sync_job(shard_server, cache_rows=0)
    cached = sync_job(shard_server, cache_rows=16, prefetch=prefetch)  # 16 < the ids a step reads: evicts
    for name, rows in plain["rows"].items():
        assert torch.equal(cached["rows"][name], rows), name
    for name, value in plain["dense"].items():  # the dense round's sum depends on arrival order (ulp)
        torch.testing.assert_close(cached["dense"][name], value, rtol=1e-6, atol=1e-9)
    for rank in range(2):
        c = cached[f"counters{rank}"]
        assert c["rows_cache_hits"] > 0 and c["rows_cache_dropped"] > 0 and c["rows_cache_evicted"] > 0, c
        assert "rows_cache_hits" not in plain[f"counters{rank}"]


def test_an_async_job_with_bound_four_trains_serving_hits_and_counts_them(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    torch.manual_seed(0)
    model = Rec(cache_rows=64, staleness=4, table_mode="async")
    with connect(",".join(s.server.address for s in shards), model, mode="sync",
                 optimizer={"name": "sgd", "lr": 0.1}) as ps:
        first = train(ps, model, 0, prefetch=False)
        for _ in range(3):
            last = train(ps, model, 0, prefetch=False)
        c = ps.counters
    assert torch.isfinite(last) and last < first
    assert c["rows_cache_hits"] > c["rows_cache_misses"] > 0 and c["rows_cache_stale"] > 0, c
    assert c["rows_applied_pushes"] > 0 and c.get("rows_stale_pushes", 0) == 0, c
