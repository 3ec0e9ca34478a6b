"""connect() with shard-backed tables against real shards on loopback: the job carries the tables, the modules are
bound once joined, step() pushes rows and dense gradients, close() closes the row client.

The row client is LocalRows standing in for trainer.tables.sparse_client.ShardedRows (the server side of issue 12 step 2
is not in this tree yet): what is tested is the wiring around it, over a real gRPC job.
"""

import pytest
import torch
from torch import nn

import trainer.stepping.api as api
from trainer.tables.embedding import LocalRows, ShardedEmbedding


class StandInRows(LocalRows):
    made = []

    def __init__(self, client, job, on_restart=None):  # on_restart: as ShardedRows (never called here)
        super().__init__(job.tables)
        self.job, self.closed = job, False
        StandInRows.made.append(self)

    @property
    def counters(self):
        return {"pushes": sum(s.version for s in self.stores.values())}

    def close(self):
        self.closed = True


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = ShardedEmbedding("users", 3, num_embeddings=10)
        self.items = ShardedEmbedding("items", 3, num_embeddings=10)
        self.out = nn.Linear(3, 1)

    def forward(self, u, i):
        return self.out(self.users(u) * self.items(i)).squeeze(-1)


@pytest.fixture
def stand_in(monkeypatch):
    StandInRows.made = []
    monkeypatch.setattr(api, "sharded_rows_class", lambda: StandInRows)
    return StandInRows.made


def test_a_model_with_tables_trains_through_real_shards_with_its_rows_on_the_bound_client(shard_server, stand_in):
    shards = [shard_server(shard=i) for i in range(2)]
    model = Scorer()
    u, i, y = torch.tensor([1, 2, 2]), torch.tensor([4, 4, 7]), torch.tensor([1.0, -1.0, 0.5])
    with api.connect(",".join(s.server.address for s in shards), model, embedding_mode="async",
                     optimizer={"name": "sgd", "lr": 0.1}) as ps:
        rows, = stand_in
        assert [t.name for t in rows.job.tables] == ["items", "users"]
        assert {t.mode for t in rows.job.tables} == {"async"} and rows.job.mode == "sync"
        assert model.users.backend is rows and "2 sparse tables" in ps.describe
        before = rows.stores["users"].lookup(torch.tensor([2])).clone()
        losses = []
        for _ in range(3):
            loss = (model(u, i) - y).pow(2).mean()
            loss.backward()
            info = ps.step(num_samples=3)
            losses.append(loss.item())
        assert rows.versions() == {"items": 3, "users": 3} and info.versions == [3, 3]
        assert not torch.equal(rows.stores["users"].lookup(torch.tensor([2])), before)
        assert ps.counters["rows_pushes"] == 6
        assert losses[-1] < losses[0]
    assert rows.closed
    assert all(list(s.stats().live_ranks) == [] for s in shards)


def test_a_model_of_tables_alone_trains_with_an_empty_dense_part(shard_server, stand_in):
    shards = [shard_server(shard=i) for i in range(2)]
    model = ShardedEmbedding("only", 2, num_embeddings=5)
    with api.connect(",".join(s.server.address for s in shards), model) as ps:
        rows, = stand_in
        assert ps.num_params == 0
        for _ in range(2):
            model(torch.tensor([0, 3])).pow(2).sum().backward()
            ps.step(num_samples=2)
        assert rows.versions() == {"only": 2}
    assert [s.stats().version for s in shards] == [2, 2]
