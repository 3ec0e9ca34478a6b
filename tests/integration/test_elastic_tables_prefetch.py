"""A trainer joins a running sync job with tables over real shards on loopback (trainers as threads), with
``ps.prefetching`` and without: the rows end bit for bit the same.  With prefetch every trainer pushes its
tables beside the dense exchange, so the joiner may find a shard one table round behind its own first round:
its lanes start at its round (trainer.membership.session.joined_round) and the shard lets its first pull wait for that one
round (ServedTable.check_wait ``joins``) -- a prefetch or row cache reading the wrong version would change a
bit.  That race (a shard one table round behind when the joiner binds) is not forced here: the decisions that
handle it are unit-tested (tests/unit/test_elastic_tables.py).  The rows of the plain run equal one process
epoch by epoch (tests/cluster/test_elastic_tables.py).

No timing: rank 0 waits before round HOLD until the join is committed (the timeline has a second epoch); the
joiner starts once rank 0 is there, so it is admitted at HOLD + JOIN_LEAD in both runs."""

from __future__ import annotations

import threading

import torch
from torch import nn

from psserver.protocol.epochs import JOIN_LEAD
from psserver.protocol.rows.optim import SparseOptimizerConfig
from tests.helpers import WAIT_TIMEOUT, run_ranks, wait_until
from trainer.stepping.api import connect
from trainer.tables.embedding import ShardedEmbedding

STEPS, B, N, HOLD = 7, 6, 40, 2


class Rec(nn.Module):
    def __init__(self):
        super().__init__()
        opt = SparseOptimizerConfig("adam", lr=0.05)
        self.user = ShardedEmbedding("user", 3, num_embeddings=N, optimizer=opt, seed=1, cache_rows=64)
        self.item = ShardedEmbedding("item", 3, num_embeddings=N, optimizer=opt, seed=2)
        self.out = nn.Linear(3, 1)

    def forward(self, users, items):
        return self.out(self.user(users) * self.item(items)).squeeze(-1)


def batch(rank: int, round_: int):
    g = torch.Generator().manual_seed(100 * round_ + rank)
    return torch.randint(0, N, (B,), generator=g), torch.randint(0, N, (B,), generator=g), torch.randn(B, generator=g)


def train(addresses: str, who: int, model: Rec, prefetch: bool, out: dict, at_hold: threading.Event) -> None:
    join = who == 2
    if join:
        assert at_hold.wait(WAIT_TIMEOUT), "rank 0 did not reach its hold"
    with connect(addresses, model, mode="sync", rank=None if join else who, num_trainers=2, max_trainers=3,
                 join=join, optimizer={"name": "sgd", "lr": 0.1}) as ps:
        first = ps.versions[0]
        batches = [batch(ps.rank, r) for r in range(first, STEPS)]
        if prefetch:
            batches = ps.prefetching(batches, forward=lambda m, b: m(*b[:2]))
        for r, (users, items, y) in enumerate(batches, start=first):
            if ps.rank == 0 and r == HOLD:
                at_hold.set()
                wait_until(lambda: len(ps.fetch_timeline()) > 1, "the joiner's commit")
            (model(users, items) - y).pow(2).mean().backward()
            ps.step(num_samples=B)
        out[f"first{ps.rank}"] = first
        if ps.rank == 0:
            out["rows"] = {name: ps.rows.pull(name, torch.arange(N)) for name in ("user", "item")}
            out["dense"] = {k: v.clone() for k, v in model.state_dict().items()}


def run_job(shard_server, prefetch: bool) -> dict:
    shards = [shard_server(shard=i) for i in range(2)]
    out, models = {}, []
    for _ in range(3):  # here, not in the threads: torch's generator is one for the process
        torch.manual_seed(0)
        models.append(Rec())
    addresses, at_hold = ",".join(s.server.address for s in shards), threading.Event()
    run_ranks(lambda who: train(addresses, who, models[who], prefetch, out, at_hold), 3, timeout=180)
    out["epochs"] = [(e.round, sorted(e.members)) for e in shards[0].stats().epochs]
    return out


def test_a_joiner_with_prefetch_and_a_row_cache_ends_with_the_rows_of_the_same_join_without_them(shard_server):
    plain = run_job(shard_server, prefetch=False)
    ahead = run_job(shard_server, prefetch=True)
    for run in (plain, ahead):
        assert run["epochs"][:2] == [(0, [0, 1]), (HOLD + JOIN_LEAD, [0, 1, 2])], run["epochs"]
        assert run["first2"] == HOLD + JOIN_LEAD
    for name, rows in plain["rows"].items():
        assert torch.equal(ahead["rows"][name], rows), name
    for name, value in plain["dense"].items():
        torch.testing.assert_close(ahead["dense"][name], value, rtol=1e-6, atol=1e-7)
