"""A trainer with a sparse table follows a layout switch (stage 6 of docs/design/live-reshard.md), on real shards over gRPC.

A sync job of a dense layer and a sync table (Adam, so rows carry optimizer state) on two shards runs R rounds;
then both processes switch offline (tests.offline_switch.switch_layout_offline) to one shard -- the first process -- of two
partitions: the dense slices re-cut, every row re-placed by splitmix64(id) mod 1, each table from its own round
(its version at the switch).  The trainer, one layout behind (its rows pulled before the switch), pushes its table
first: every old shard refuses it ``layout-moved`` (nothing applied), it learns the layout, rebuilds its row routing, lanes and row calls for one
shard, and sends the step whole in the new layout.  Its dense weights and every table row -- values and
optimizer state -- must equal bit for bit those of the same job that never switched.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.nn import functional as F

from psserver.protocol.rows.optim import SparseOptimizerConfig
from tests.integration.test_relayout import switch_to_one_shard, two_trainers
from trainer import connect
from trainer.tables.embedding import ShardedEmbedding

STEPS, R = 6, 3
OPTIMIZER = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
IDS = 40  # ids 0..39: both old shards hold some of every batch's rows


class Net(torch.nn.Module):
    """An embedding of ids (a sync table on the shards) summed into a small dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = ShardedEmbedding("emb", 6, optimizer=SparseOptimizerConfig("adam", lr=0.05))
        self.head = torch.nn.Linear(6 + 12, 4)

    def forward(self, ids, x):
        return self.head(torch.cat([self.emb(ids).sum(1), x], 1))


def batch(g: torch.Generator):
    return (torch.randint(0, IDS, (8, 3), generator=g), torch.randn(8, 12, generator=g),
            torch.randint(0, 4, (8,), generator=g))


def table_rows(servers) -> dict:
    """Every row of table ``emb`` held by the newest layout of ``servers`` (the processes it names), by id: values,
    optimizer state and the version each was last updated at, as the shards hold them."""
    stores = []
    for s in servers:
        layout = s.layouts.timeline()[-1]
        if not layout.addresses or s.address in layout.addresses:  # (a drained process serves nothing of it)
            stores.append(s.layouts.current.head.capture().tables["emb"]["rows"])
    ids = torch.cat([st["ids"] for st in stores])
    order = torch.argsort(ids)
    return {k: torch.cat([st[k] for st in stores])[order] for k in ("ids", "rows", "optimizer_state", "last_version")}


def same_rows(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def train(servers, switch_at=None, before_step=lambda ps: None, connected=lambda ps: None, prefetch=False,
          partitions=None, after_pulls=False, one_call=True):
    """STEPS sync steps of one trainer (``prefetch``: each batch's rows pulled one step ahead, the steps then go
    as one Step call a shard, or beside the dense exchange when partitioned); (its dense parameters, its counters,
    its job, the shards' rows).  ``after_pulls``: the switch comes after step ``switch_at``'s forward and backward
    (its rows pulled in the old layout, their replies naming it), before its push.  ``one_call`` False: a step's
    parts go the two-call way (the tables pushed, then the dense exchange), not as one Step call a shard."""
    model, g = Net(), torch.Generator().manual_seed(7)
    with connect(",".join(s.address for s in servers), model, mode="sync", rank=0, num_trainers=1,
                 optimizer=OPTIMIZER, connect_timeout=30, partitions=partitions) as ps:
        ps.step_call.enabled = one_call
        connected(ps)
        batches = [batch(g) for _ in range(STEPS)]
        for i, (ids, x, y) in enumerate(ps.prefetching(batches, ids_of=lambda b: {"emb": b[0]}) if prefetch
                                        else batches):
            if i == switch_at and not after_pulls:
                switch_to_one_shard(servers)
                before_step(ps)
            ps.prepare_step(len(x))
            F.cross_entropy(model(ids, x), y).backward()
            if i == switch_at and after_pulls:
                switch_to_one_shard(servers)
                before_step(ps)
            ps.step(num_samples=len(x))
        ps.flush()
        dense = model.head.weight.detach().clone().reshape(-1)
        counters = Counter(ps.client.counters) + Counter(ps.rows.counters)
        return dense, counters, ps.job, table_rows(servers)


@pytest.mark.parametrize("one_call", [False, True], ids=["two-calls", "one-call"])
def test_a_trainer_whose_table_push_is_refused_layout_moved_reroutes_the_step_and_ends_bit_for_bit_as_without_a_switch(
        shard_server, one_call):
    dense_ref, _, _, rows_ref = train([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]
    dense, counters, job, rows = train(servers, switch_at=R, after_pulls=True, one_call=one_call)
    assert torch.equal(dense, dense_ref)
    assert same_rows(rows, rows_ref)  # every row: values, Adam's moments, the version it was last updated at
    assert (job.num_shards, job.partitions) == (1, 2)
    assert counters["row_pushes_rerouted"] == 2  # both old shards refused the table push at base R; sent again whole
    if one_call:  # both old shards refused step R's Step call whole: its dense part went again too
        assert counters["pushes_rerouted"] == 2 and counters["step_calls_fallen_back"] == 1
    else:
        assert counters["pushes_rerouted"] == 0  # the dense exchange went in the new layout from the start


def test_a_trainer_learns_a_switch_from_its_row_pulls_reply_and_pushes_its_table_in_the_new_layout_at_once(
        shard_server):
    """The switch comes before step R's forward: its rows, pulled in the old layout (a tombstone answers pulls up to
    R), come back naming layout 1 (RowsHeader.layout_epoch), so the trainer switches before its push: nothing
    refused or re-routed, and it still ends bit for bit as without a switch."""
    dense_ref, _, _, rows_ref = train([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]
    dense, counters, job, rows = train(servers, switch_at=R)
    assert torch.equal(dense, dense_ref) and same_rows(rows, rows_ref)
    assert (job.num_shards, counters["layouts_followed"]) == (1, 1)
    assert (counters["row_pushes_rerouted"], counters["pushes_rerouted"], counters["retries"]) == (0, 0, 0), counters
    assert (counters["layouts_followed"], counters["layout_fetches"], counters["tables_relaid"]) == (1, 1, 1)
    assert counters["steps_failed"] == counters["table_pushes_failed"] == counters["pushes_lost"] == 0
    head = servers[0].layouts.current.head
    assert head.tables.get("emb").version == STEPS  # every table round applied once, in its layout
    assert servers[0].layouts.host(0).head.tables.get("emb").version == R  # the tombstone: nothing after the switch
    assert servers[0].layouts.timeline()[1].table_rounds == (("emb", R),)


def test_a_trainer_that_saw_the_new_layout_switches_its_tables_before_pushing_and_nothing_is_refused(shard_server):
    dense_ref, _, _, rows_ref = train([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]

    def hear_of_it(ps):
        """A heartbeat names layout 1 in its reply."""
        s = ps.client.parts[0]
        s.heartbeat(timeout=10)
        assert (s.calls.layout_seen, s.caller.layout_epoch) == (1, 0)

    dense, counters, _, rows = train(servers, switch_at=R, before_step=hear_of_it)
    assert torch.equal(dense, dense_ref) and same_rows(rows, rows_ref)
    assert counters["row_pushes_rerouted"] == counters["pushes_rerouted"] == 0 and counters["layouts_followed"] == 1


def test_a_switch_between_a_steps_table_push_and_its_dense_push_starts_the_table_a_round_later_and_is_exact(
        shard_server):
    """Two calls, tables first: switched after step R's table push (the table at R + 1) and before its dense push
    (dense at R), the table's switch round is its own, R + 1 -- so only the dense push is refused and re-routed,
    and the tables follow it at R + 1."""
    dense_ref, _, _, rows_ref = train([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]

    def switch_before_step_rs_dense_push(ps):
        dense_step = ps.runner._dense_step

        def switching(num_samples):
            if ps.versions[0] == R and servers[0].layouts.newest == 0:
                switch_to_one_shard(servers)
            return dense_step(num_samples)

        ps.runner._dense_step = switching

    dense, counters, _, rows = train(servers, connected=switch_before_step_rs_dense_push, one_call=False)
    assert torch.equal(dense, dense_ref) and same_rows(rows, rows_ref)
    assert servers[0].layouts.timeline()[1].table_rounds == (("emb", R + 1),)
    assert (counters["pushes_rerouted"], counters["row_pushes_rerouted"], counters["tables_relaid"]) == (2, 0, 1)
    assert servers[0].layouts.host(0).head.tables.get("emb").version == R + 1  # the tombstone took step R's rows


@pytest.mark.parametrize("partitions", [None, 2])
def test_a_trainer_prefetching_rows_follows_the_switch_its_refused_step_rerouted_whole_and_is_exact(
        shard_server, partitions):
    """Prefetching, a step goes as one Step call a shard (unpartitioned), else its tables on their thread beside
    the dense exchange (partitioned): every part refused layout-moved is taken back once both settled, and the
    step goes again whole; the prefetched rows of the old shards are dropped."""
    dense_ref, _, _, rows_ref = train([shard_server(shard=i).server for i in range(2)], prefetch=True,
                                      partitions=partitions)
    servers = [shard_server(shard=i).server for i in range(2)]
    dense, counters, job, rows = train(servers, switch_at=R, prefetch=True, partitions=partitions)
    assert torch.equal(dense, dense_ref) and same_rows(rows, rows_ref)
    assert (job.num_shards, job.partitions) == (1, 2)
    assert counters["pushes_rerouted"] == 2 * (partitions or 1) and counters["row_pushes_rerouted"] == 2
    assert (counters["step_calls"] > 0) == (partitions is None)  # the variant each case runs
    assert counters["layouts_followed"] == counters["tables_relaid"] == 1
    assert counters["steps_failed"] == counters["table_pushes_failed"] == counters["pushes_lost"] == 0
    assert servers[0].layouts.current.head.tables.get("emb").version == STEPS


def train_two(servers, switch_at=None):
    """test_relayout's ``two_trainers`` of this Net: with ``switch_at`` every dense and table round up to R closed,
    none open, at the switch.  (Their dense parameters, their counters, the shards' rows.)"""
    def loss(model, g, ps):
        ids, x, y = batch(g)
        ps.prepare_step(len(x))
        return F.cross_entropy(model(ids, x), y), len(x)

    results, counters = two_trainers(servers, Net, loss, lambda m: m.head.weight.detach().clone().reshape(-1),
                                     lambda ps: Counter(ps.client.counters) + Counter(ps.rows.counters), switch_at)
    return results, counters, table_rows(servers)


def test_two_sync_trainers_with_a_table_both_follow_the_switch_and_end_bit_for_bit_as_without_one(shard_server):
    reference, _, rows_ref = train_two([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]
    results, counters, rows = train_two(servers, switch_at=R)
    assert torch.equal(results[0], reference[0]) and torch.equal(results[1], reference[1])
    assert torch.equal(results[0], results[1])  # sync: both hold the same weights
    assert same_rows(rows, rows_ref)
    for rank in (0, 1):
        # each learned the switch from its step's row pulls (their replies name layout 1): its push went there at once
        assert (counters[rank]["row_pushes_rerouted"], counters[rank]["layouts_followed"]) == (0, 1)
        assert counters[rank]["steps_failed"] == counters[rank]["table_pushes_failed"] == 0
    assert servers[0].layouts.current.head.tables.get("emb").version == STEPS
