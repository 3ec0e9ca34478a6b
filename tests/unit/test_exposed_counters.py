"""A shard's read counters (Shard.exposed: what a hot standby's primary compares to let a pull go out on a shipment
already made, psserver.replication.shipper) move with everything a pull can show -- the parameters set, a step,
a registration, a leave, a table's update or eviction, a pull where reads decide which rows stay -- and not with
a pull alone (the rows it creates come back the same from seed and id)."""

import dataclasses

import pytest
import torch

from psserver.partition.shard import Shard
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.sparse.serving import Membership, RowsPush, ServedTable
from tests.conftest import P, make_spec

FP = "f" * 16


def two() -> Shard:
    shard = Shard(0, clock=lambda: 100.0, lease_timeout=600.0)
    spec = make_spec(num_trainers=2, max_trainers=2)
    shard.register(0, "t0", 0, spec)
    return shard


def test_registration_init_steps_and_a_leave_each_move_the_counters_and_a_pull_does_not():
    shard = two()
    seen = [shard.exposed()]
    shard.register(1, "t1", 0, make_spec(num_trainers=2, max_trainers=2))
    seen.append(shard.exposed())
    shard.init(0, "t0", FP, torch.zeros(P))  # the weights a waiting pull shows next
    seen.append(shard.exposed())
    shard.push(0, "t0", FP, 0, 1, torch.ones(P), 1)
    shard.push(1, "t1", FP, 0, 1, torch.ones(P), 1)  # the round closes: a step
    seen.append(shard.exposed())
    version, snapshot = shard.slice.acquire(pb.FLOAT32)  # a pull's read
    shard.slice.release(snapshot)
    assert shard.exposed() == seen[-1]
    shard.leave(1, "t1", FP)  # a new epoch at the current version, which a pull's header names
    seen.append(shard.exposed())
    assert len(set(seen)) == len(seen), seen


def table(kind: str, **spec) -> ServedTable:
    t = TableSpec("emb", 4, optimizer=SparseOptimizerConfig("adagrad", lr=0.1), seed=3, mode="async",
                  initializer=Initializer(kind, 0.1), **spec)
    job = dataclasses.replace(make_spec(num_trainers=2, mode="async"), tables=(t,))
    return ServedTable(t, job)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_a_tables_counters_move_with_updates_and_not_with_the_rows_a_pull_creates(kind):
    t = table(kind)
    before = t.exposed()
    t.lookup(torch.arange(10))  # rows created: made the same again from (seed, id), in any batch
    assert t.exposed() == before
    t.push(RowsPush(0, "t0", t.version, 1, 1, torch.arange(3), torch.ones(3, 4)),
           Membership(frozenset({0, 1}), started=True), now=0.0)
    assert t.exposed() != before


@pytest.mark.parametrize("spec", [{"max_rows": 100}, {"evict_after": 5}, {"admit_after": 2}])
def test_a_pull_of_a_table_whose_reads_decide_what_stays_moves_the_counters(spec):
    t = table("uniform", **spec)
    before = t.exposed()
    t.lookup(torch.arange(10))
    assert t.exposed() != before
