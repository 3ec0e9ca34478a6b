"""Exact accounting under connection faults: nothing lost, nothing applied twice -- for dense pushes and row pushes.

Two trainers (threads using the Python API) push integer-valued gradients
through fault-injecting proxies to two real ps-server processes; plain SGD with
lr 1 makes every update exact in fp32.  At the end each shard's parameters must
equal exactly minus the sum of what it acknowledged: every acknowledged push in
async mode, the mean of each round's acknowledged pushes in the sync modes.
"""

from collections import defaultdict

import pytest
import torch

from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.stubs import fetch_stat as stats
from tests.cluster.helpers import closed_rounds, exact_sgd, pull_params, trainers_through_faults
from trainer import connect
from trainer.stepping.api import make_job
from trainer.channels.client import ShardedClient
from trainer.tables.embedding import ShardedEmbeddingBag
from trainer.tables.sparse_client import ShardedRows

P, STEPS, TRAINERS = 20_000, 40, 2
ACKED = {"applied", "accepted", "duplicate"}


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(P))


def run_trainer(rank, addresses, mode, records, errors):
    try:
        model = Flat()
        ps = connect(addresses, model, mode=mode, rank=rank, num_trainers=TRAINERS, trainer_id=f"soak-{rank}",
                     optimizer={"name": "sgd", "lr": 1.0}, sync_timeout=0.3, connect_timeout=60)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            grad = torch.randint(-8, 9, (P,), generator=gen).float()
            model.w.grad = grad.clone()
            bases = list(ps.versions)
            info = ps.step(num_samples=1)
            records.append((bases, info.outcomes, grad))
        records.append(("counters", ps.counters))
        # Rank 0 stays registered (a left rank is forgotten) so the test can read the final weights as it.
        ps.close(leave=rank != 0)
    except Exception as e:  # reported by the test thread
        errors.append(e)


@pytest.mark.parametrize("mode", ["sync", "async", "stale-timeout"])
def test_final_parameters_equal_the_sum_of_acknowledged_gradients(tmp_path, mode):
    faults = dict(seeds=[len(mode), 7 + len(mode)], mean_bytes_between_faults=150_000, max_faults=25, max_delay=0.002)
    with trainers_through_faults(tmp_path, run_trainer, (mode,), TRAINERS, **faults) as (shards, records):
        counters = [r[-1][1] for r in records]
        assert sum(c.get("retries", 0) for c in counters) > 0

        bounds = [(0, P // 2), (P // 2, P)]
        for shard, (start, end) in enumerate(bounds):
            by_base = defaultdict(list)  # base version -> acknowledged gradient slices
            for rank_records in records:
                for bases, outcomes, grad in rank_records[:-1]:
                    if outcomes[shard] in ACKED:
                        by_base[bases[shard]].append(grad[start:end])
            got = pull_params(shards[shard].address, "soak-0", make_job(Flat(), len(shards)).fingerprint)
            st = stats(shards[shard].address)
            expected = exact_sgd(by_base, mode, st.version)
            assert torch.equal(got, expected), (got - expected).abs().max()
            applied_rounds = (closed_rounds(by_base, st.version) if mode != "async"
                              else sum(len(g) for g in by_base.values()))
            assert st.version == applied_rounds


# -- row pushes: the same accounting for a sparse table ------------------------------------------------------------

ROW_IDS, DIM, BAGS, ROW_STEPS = 300, 8, 16, 24


class Bags(torch.nn.Module):
    """A table alone, rows starting at zero, SGD with lr 1: every update is exact in fp32."""

    def __init__(self):
        super().__init__()
        self.emb = ShardedEmbeddingBag("emb", DIM, mode="sum", initializer=Initializer(scale=0.0),
                                       optimizer=SparseOptimizerConfig("sgd", lr=1.0))


def run_rows_trainer(rank, addresses, mode, records, errors):
    """Train ``Bags`` with integer-valued gradients; every answered row push is recorded as
    (shard, base version, outcome, ids, gradient rows) -- what the shard said, after any retries."""
    try:
        model = Bags()
        ps = connect(addresses, model, mode=mode, rank=rank, num_trainers=TRAINERS, trainer_id=f"rows-{rank}",
                     connect_timeout=60)
        # each table push its own call, recorded below (one Step call a shard through the same faults:
        # tests/cluster/test_step_soak.py)
        ps.step_call.enabled = False
        rows, push_shard = ps.rows, ps.rows.pushes.push_shard

        def recorded(s, table, ids, grads, n):
            base = rows.book.lanes[(s.index, table)].base
            outcome = push_shard(s, table, ids, grads, n)
            records.append((s.index, base, outcome, ids.clone(), grads.clone()))
            return outcome

        rows.pushes.push_shard = recorded
        gen = torch.Generator().manual_seed(200 + rank)
        for _ in range(ROW_STEPS):
            ids = torch.randint(0, ROW_IDS, (BAGS * 3,), generator=gen)
            weights = torch.randint(-4, 5, (BAGS, DIM), generator=gen).float()
            (model.emb(ids, torch.arange(0, BAGS * 3, 3)) * weights).sum().backward()
            ps.step(num_samples=1)
        records.append(("counters", ps.counters, ps.job))
        ps.close(leave=rank != 0)  # rank 0 stays registered: the test reads the final rows as it
    except Exception as e:  # reported by the test thread
        errors.append(e)


def expected_rows(records, shard, mode, version) -> torch.Tensor:
    """Where ``shard``'s rows must end at table version ``version``: exact SGD of its acknowledged gradient rows."""
    by_base = defaultdict(list)
    for rank_records in records:
        for s, base, outcome, ids, grads in rank_records[:-1]:
            if s == shard and outcome in ACKED:
                by_base[base].append(torch.zeros(ROW_IDS, DIM).index_add_(0, ids, grads))
    return exact_sgd(by_base, mode, version)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_row_pushes_through_faults_are_applied_exactly_once_each(tmp_path, mode):
    faults = dict(seeds=[len(mode), 11 + len(mode)], mean_bytes_between_faults=4_000, max_faults=20, max_delay=0.001)
    with trainers_through_faults(tmp_path, run_rows_trainer, (mode,), TRAINERS, **faults) as (shards, records):
        counters = [r[-1][1] for r in records]
        assert sum(c.get("rows_retries", 0) for c in counters) > 0  # ... to row calls too
        job = records[0][-1][2]

        reader = ShardedClient([s.address for s in shards], job, 0, "rows-0")
        try:
            final = ShardedRows(reader, job).pull("emb", torch.arange(ROW_IDS))
        finally:
            reader.close()
        owner = shard_of(torch.arange(ROW_IDS), 2)
        for shard in range(2):
            mine = owner == shard
            st = stats(shards[shard].address).counters
            version = int(st["table.emb.version"])
            expected = expected_rows(records, shard, mode, version)
            assert torch.equal(final[mine], expected[mine]), (final[mine] - expected[mine]).abs().max()
            answered = [o for rr in records for s, _, o, _, _ in rr[:-1] if s == shard]
            # every push the shard applied was acknowledged to its trainer once: directly or as DUPLICATE
            assert st["table.emb.pushes_applied"] == sum(o in ACKED for o in answered) == ROW_STEPS * TRAINERS
            assert st["table.emb.pushes_duplicate"] >= answered.count("duplicate")
            rounds = closed_rounds([b for rr in records for s, b, o, _, _ in rr[:-1] if s == shard and o in ACKED],
                                   version)
            assert version == (ROW_STEPS * TRAINERS if mode == "async" else rounds)
        assert sum(c.get("rows_duplicate_pushes", 0) for c in counters) == sum(
            o == "duplicate" for rr in records for _, _, o, _, _ in rr[:-1])
