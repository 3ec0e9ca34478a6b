"""connect()/make_job()/step() with shard-backed tables, without a network: the job's tables and the step's order."""

from types import SimpleNamespace

import grpc
import pytest
import torch
from torch import nn

from trainer.stepping.api import connect, make_job
from trainer.tables.embedding import LocalRows, ShardedEmbedding, ShardedEmbeddingBag
from trainer.stepping.step import StepRunner
from trainer.stepping.table_push import TablePush


class Tower(nn.Module):
    def __init__(self, **modes):
        super().__init__()
        self.items = ShardedEmbeddingBag("items", 4, mode="sum", table_mode=modes.get("items", ""))
        self.users = ShardedEmbedding("users", 4, mode=modes.get("users", ""))
        self.head = nn.Linear(8, 1)

    def forward(self, users, items, offsets):
        return self.head(torch.cat([self.users(users), self.items(items, offsets)], -1)).squeeze(-1)


def test_the_job_lists_the_models_tables_sorted_by_name_and_no_dense_parameter_for_them():
    job = make_job(Tower(), num_shards=2)
    assert [t.name for t in job.tables] == ["items", "users"]
    assert [name for name, _, _ in job.tensors] == ["head.weight", "head.bias"]
    assert job.total_params == 9


def test_embedding_mode_async_applies_to_tables_without_a_mode_of_their_own():
    job = make_job(Tower(users="sync"), num_shards=1, mode="sync", embedding_mode="async")
    assert {t.name: t.mode for t in job.tables} == {"items": "async", "users": "sync"}
    assert make_job(Tower(), num_shards=1).tables[0].mode == ""


def test_a_bad_embedding_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match="table mode \\('sideways'\\)"):
        make_job(Tower(), num_shards=1, embedding_mode="sideways")


def test_two_tables_sharing_a_name_are_refused_before_anything_starts():
    model = nn.ModuleList([ShardedEmbedding("t", 2), ShardedEmbedding("t", 2), nn.Linear(1, 1)])
    with pytest.raises(ValueError, match="two tables of the model are named 't'"):
        connect("127.0.0.1:1", model)


# -- step(): tables first, each pushed once per step, a failed one retried alone ---------------------------------

class FlakyRows(LocalRows):
    """Fails the first push of the tables named in ``fail``, as a shard that is down would."""

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    def __init__(self, tables, fail):
        super().__init__(tables)
        self.fail, self.log = set(fail), []

    def push(self, table, ids, grads, num_samples):
        self.log.append((table, ids.tolist()))
        if table in self.fail:
            self.fail.discard(table)
            raise self.Down()
        super().push(table, ids, grads, num_samples)


class Counter:
    def __init__(self):
        self.counts = {}

    def count(self, name, n=1):
        self.counts[name] = self.counts.get(name, 0) + n


class StandInExchange:
    """The dense part of a step, counted: nothing fails there."""

    def __init__(self):
        self.attempt, self.dense_steps = None, 0

    def dense_step(self, num_samples):
        self.dense_steps += 1
        return "dense done"

    def abandon(self):
        return []


def stepper(model, rows, flat=None):
    """trainer.stepping.step's runner with only what step() needs for its tables (the facade's step() delegates to it);
    the dense part is a stand-in.  Returns the runner and what it counts with."""
    tables = sorted([m for m in model.modules() if isinstance(m, (ShardedEmbedding, ShardedEmbeddingBag))],
                    key=lambda t: t.name)
    client = Counter()
    runner = StepRunner(StandInExchange(), TablePush(tables, client), SimpleNamespace(rank=0, step_begins=lambda: None, step_ends=lambda: None), flat,
                        client.count)
    for t in tables:
        t.bind(rows)
    return runner, client


def test_a_table_push_that_fails_raises_and_the_retry_pushes_only_that_table_then_the_dense_step():
    model = Tower()
    rows = FlakyRows([t.spec for t in (model.items, model.users)], fail={"users"})
    runner, client = stepper(model, rows)
    model(torch.tensor([1, 2]), torch.tensor([5, 6, 5]), torch.tensor([0, 1])).sum().backward()
    with pytest.raises(grpc.RpcError):
        runner.step(num_samples=2)
    assert rows.log == [("items", [5, 6]), ("users", [1, 2])] and runner.exchange.dense_steps == 0
    assert client.counts == {"table_pushes_failed": 1}
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) while a failed step waits"):
        runner.zero_grad()
    assert runner.step(num_samples=2) == "dense done"
    assert rows.log[2:] == [("users", [1, 2])] and runner.exchange.dense_steps == 1
    assert rows.versions() == {"items": 1, "users": 1}
    runner.step(num_samples=2)  # a step with no forward still pushes every table (no ids): one version each
    assert rows.log[3:] == [("items", []), ("users", [])] and rows.versions() == {"items": 2, "users": 2}


def test_abandoning_a_failed_table_push_drops_its_rows_and_the_next_step_starts_afresh():
    model = Tower()
    rows = FlakyRows([t.spec for t in (model.items, model.users)], fail={"items"})
    runner, client = stepper(model, rows, flat=type("Flat", (), {"zero_grad": lambda self: None})())
    model(torch.tensor([3]), torch.tensor([4]), torch.tensor([0])).sum().backward()
    with pytest.raises(grpc.RpcError):
        runner.step(num_samples=1)
    runner.abandon()
    assert client.counts["steps_abandoned"] == 1
    runner.step(num_samples=1)
    assert rows.log[1:] == [("items", []), ("users", [])]
